"""Spot / preemptible instance notices: a background thread polls the cloud's metadata endpoint.

A cloud reclaims a spot VM with a short warning (AWS: 2 minutes, Azure: 30 s or more, GCP: 30 s)
published on the VM's metadata server. ``NoticeWatcher`` asks for it every ``interval`` seconds
and, when a notice appears, calls ``on_notice`` once with a one-line description; fault/preemption.py
turns that into the same stop request a SIGTERM makes, so every rank checkpoints at the same step
and exits 75. The training step never waits for it: the thread only sets a flag.

Every request has a bounded timeout and bypasses HTTP proxies (metadata servers are link-local).
An unreachable endpoint is reported once, then polled quietly.

    aws    IMDSv2: PUT /latest/api/token, then GET /latest/meta-data/spot/instance-action with the
           token (404 = no notice; 200 = {"action": "terminate", "time": ...})
    azure  Scheduled Events: GET /metadata/scheduledevents (header Metadata: true); an event with
           EventType "Preempt" naming this VM (or no VM) is the notice
    gcp    GET /computeMetadata/v1/instance/preempted (header Metadata-Flavor: Google): TRUE or FALSE
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Callable

CLOUDS = ("aws", "azure", "gcp")
DEFAULT_URLS = {"aws": "http://169.254.169.254", "azure": "http://169.254.169.254",
                "gcp": "http://metadata.google.internal"}
TIMEOUT_SECONDS = 2.0
AWS_TOKEN_TTL_SECONDS = 21600
AZURE_API_VERSION = "2020-07-01"


class Unreachable(Exception):
    """The metadata endpoint did not answer, or answered something that is not the cloud's."""


# Metadata servers are on the local link: a configured HTTP proxy must never see these requests.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(url: str, method: str = "GET", headers: dict[str, str] | None = None,
            timeout: float = TIMEOUT_SECONDS) -> tuple[int, dict[str, str], str]:
    """(status, headers, body) of one HTTP request; HTTP error statuses are returned, not raised."""
    req = urllib.request.Request(url, method=method, headers=headers or {})
    try:
        with _OPENER.open(req, timeout=timeout) as response:
            return response.status, dict(response.headers), response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as error:
        body = error.read().decode("utf-8", "replace") if error.fp else ""
        return error.code, dict(error.headers or {}), body
    except (urllib.error.URLError, OSError, ValueError) as error:
        reason = getattr(error, "reason", error)
        raise Unreachable(f"{url}: {reason}") from None


class Cloud:
    """One cloud's notice check; ``check`` returns a one-line notice or None."""

    name = ""

    def __init__(self, base_url: str = "", timeout: float = TIMEOUT_SECONDS):
        self.base = (base_url or DEFAULT_URLS[self.name]).rstrip("/")
        self.timeout = timeout

    def check(self) -> str | None:
        raise NotImplementedError


class Aws(Cloud):
    name = "aws"

    def __init__(self, base_url: str = "", timeout: float = TIMEOUT_SECONDS):
        super().__init__(base_url, timeout)
        self.token = ""

    def _token(self) -> str:
        status, _, body = request(f"{self.base}/latest/api/token", "PUT",
                                  {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_SECONDS)}, self.timeout)
        if status != 200 or not body.strip():
            raise Unreachable(f"{self.base}/latest/api/token answered HTTP {status} "
                              "(is this an EC2 instance with IMDSv2?)")
        return body.strip()

    def check(self) -> str | None:
        for _ in range(2):  # a token expires (or the instance was restarted): one fresh token, one retry
            self.token = self.token or self._token()
            status, _, body = request(f"{self.base}/latest/meta-data/spot/instance-action", "GET",
                                      {"X-aws-ec2-metadata-token": self.token}, self.timeout)
            if status == 401:
                self.token = ""
                continue
            if status == 404:
                return None
            if status != 200:
                raise Unreachable(f"spot/instance-action answered HTTP {status}")
            try:
                action = json.loads(body)
                return f"an AWS spot interruption notice ({action['action']} at {action['time']})"
            except (ValueError, KeyError, TypeError):
                raise Unreachable("spot/instance-action answered something that is not its JSON: "
                                  f"{body[:80]!r}") from None
        raise Unreachable("the IMDSv2 token was refused twice")


class Azure(Cloud):
    name = "azure"

    def __init__(self, base_url: str = "", timeout: float = TIMEOUT_SECONDS):
        super().__init__(base_url, timeout)
        self.vm_name: str | None = None  # asked once; "" = unknown, then any Preempt event counts

    def _name(self) -> str:
        status, _, body = request(f"{self.base}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                                  "GET", {"Metadata": "true"}, self.timeout)
        return body.strip() if status == 200 else ""

    def check(self) -> str | None:
        if self.vm_name is None:
            self.vm_name = self._name()
        status, _, body = request(f"{self.base}/metadata/scheduledevents?api-version={AZURE_API_VERSION}",
                                  "GET", {"Metadata": "true"}, self.timeout)
        if status != 200:
            raise Unreachable(f"scheduledevents answered HTTP {status}")
        try:
            events = json.loads(body)["Events"]
        except (ValueError, KeyError, TypeError):
            raise Unreachable(f"scheduledevents answered something that is not its JSON: {body[:80]!r}") from None
        for event in events:
            resources = event.get("Resources") or []
            if event.get("EventType") == "Preempt" and (not self.vm_name or not resources or self.vm_name in resources):
                return (f"an Azure Scheduled Events Preempt notice ({event.get('EventId', '?')}, "
                        f"not before {event.get('NotBefore') or 'now'})")
        return None


class Gcp(Cloud):
    name = "gcp"

    def check(self) -> str | None:
        status, headers, body = request(f"{self.base}/computeMetadata/v1/instance/preempted", "GET",
                                        {"Metadata-Flavor": "Google"}, self.timeout)
        # The real server always answers with this header; anything else (a captive portal) is not it.
        if status != 200 or headers.get("Metadata-Flavor") != "Google":
            raise Unreachable(f"instance/preempted answered HTTP {status} without Metadata-Flavor: Google")
        return "a GCP preemption notice (instance/preempted = TRUE)" if body.strip() == "TRUE" else None


CLOUD_CLASSES: dict[str, type[Cloud]] = {"aws": Aws, "azure": Azure, "gcp": Gcp}


class NoticeWatcher:
    """Polls ``cloud`` on a daemon thread; calls ``on_notice(line)`` once when a notice appears.

    ``say`` gets at most two lines in the thread's life: where it watches, and, the first time the
    endpoint does not answer, that it keeps polling quietly.
    """

    def __init__(self, cloud: str, base_url: str, interval: float, on_notice: Callable[[str], None],
                 say: Callable[[str], None] | None = None, timeout: float = TIMEOUT_SECONDS):
        self.cloud = CLOUD_CLASSES[cloud](base_url, timeout)
        self.interval = interval
        self.on_notice = on_notice
        self.say = say or (lambda line: None)
        self.notice: str | None = None
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"hvdtrain-{cloud}-notice", daemon=True)

    def start(self) -> "NoticeWatcher":
        self.say(f"hvdtrain: watching for {self.cloud.name} preemption notices at {self.cloud.base} "
                 f"every {self.interval:g} s")
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.cloud.timeout + 1)

    def poll_once(self) -> str | None:
        """One check; a notice is remembered and reported; an unreachable endpoint is said once."""
        try:
            notice = self.cloud.check()
        except Unreachable as error:
            self.failures += 1
            if self.failures == 1:
                self.say(f"hvdtrain: the {self.cloud.name} metadata endpoint does not answer ({error}); "
                         f"polling it quietly every {self.interval:g} s")
            return None
        if notice and self.notice is None:
            self.notice = notice
            self.on_notice(notice)
        return notice

    def _run(self) -> None:
        while not self._stop.is_set() and self.notice is None:
            self.poll_once()
            self._stop.wait(self.interval)
