"""A real HTTP server on loopback that answers like a cloud's metadata endpoint: no notice until
``notice`` is set, then the cloud's notice. Ports 27100-27199 only (this project's range for it).

    aws    PUT /latest/api/token (TTL header required) -> token; GET spot/instance-action with the
           token -> 404, then {"action": "terminate", "time": ...}; a wrong or missing token -> 401
    azure  GET /metadata/scheduledevents (Metadata: true) -> {"Events": []}, then a Preempt event
           for this VM (and a Freeze event for another); /metadata/instance/compute/name -> the VM
    gcp    GET /computeMetadata/v1/instance/preempted (Metadata-Flavor: Google) -> FALSE, then TRUE,
           answered with the Metadata-Flavor: Google header
"""

from __future__ import annotations

import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

PORTS = range(27100, 27200)
AWS_TOKEN = "AQAEAFakeTokenForTests=="
AZURE_VM = "hvdtrain-node0"


class Handler(BaseHTTPRequestHandler):
    server: "MetadataServer"

    def log_message(self, *args) -> None:  # quiet: the tests read server.requests instead
        pass

    def _send(self, status: int, body: str = "", headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_PUT(self) -> None:
        self.server.record(self)
        if self.server.cloud == "aws" and self.path == "/latest/api/token":
            if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                return self._send(400, "missing TTL header")
            return self._send(200, AWS_TOKEN)
        self._send(404)

    def do_GET(self) -> None:
        self.server.record(self)
        cloud, notice = self.server.cloud, self.server.notice.is_set()
        if cloud == "aws" and self.path == "/latest/meta-data/spot/instance-action":
            if self.headers.get("X-aws-ec2-metadata-token") != AWS_TOKEN:
                return self._send(401)
            if not notice:
                return self._send(404, "Not Found")
            return self._send(200, json.dumps({"action": "terminate", "time": "2026-11-23T04:12:00Z"}))
        if cloud == "azure" and self.path.startswith("/metadata/"):
            if self.headers.get("Metadata") != "true":
                return self._send(400, '{"error": "Bad request. Required metadata header not specified"}')
            if self.path.startswith("/metadata/instance/compute/name"):
                return self._send(200, AZURE_VM)
            if self.path.startswith("/metadata/scheduledevents"):
                events = [{"EventId": "A123BC45-1234-5678-AB90-ABCDEF123456", "EventStatus": "Scheduled",
                           "EventType": "Freeze", "ResourceType": "VirtualMachine", "Resources": ["other-vm"],
                           "NotBefore": "Mon, 23 Nov 2026 04:12:00 GMT", "Description": "", "EventSource": "Platform",
                           "DurationInSecs": 9}]
                if notice:
                    events.append({"EventId": "C7061BAC-AFDC-4513-B24B-AA5F13A16123", "EventStatus": "Scheduled",
                                   "EventType": "Preempt", "ResourceType": "VirtualMachine", "Resources": [AZURE_VM],
                                   "NotBefore": "Mon, 23 Nov 2026 04:12:30 GMT", "Description": "",
                                   "EventSource": "Platform", "DurationInSecs": -1})
                return self._send(200, json.dumps({"DocumentIncarnation": 2 if notice else 1, "Events": events}))
        if cloud == "gcp" and self.path == "/computeMetadata/v1/instance/preempted":
            if self.headers.get("Metadata-Flavor") != "Google":
                return self._send(403, "Missing Metadata-Flavor:Google header.")
            return self._send(200, "TRUE" if notice else "FALSE", {"Metadata-Flavor": "Google"})
        self._send(404, "Not Found")


class MetadataServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, cloud: str, port: int):
        super().__init__(("127.0.0.1", port), Handler)
        self.cloud = cloud
        self.notice = threading.Event()
        self.requests: list[tuple[str, str, dict[str, str]]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, handler: Handler) -> None:
        with self.lock:
            self.requests.append((handler.command, handler.path, {k.lower(): v for k, v in handler.headers.items()}))


@contextlib.contextmanager
def metadata_server(cloud: str) -> Iterator[MetadataServer]:
    """A running server on the first free port of PORTS; shut down on exit, also on failure."""
    for port in PORTS:
        try:
            server = MetadataServer(cloud, port)
            break
        except OSError:
            continue
    else:
        raise RuntimeError(f"no free port in {PORTS.start}-{PORTS.stop - 1} for the metadata server")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def free_port() -> int:
    """A port of PORTS nobody listens on (for the 'unreachable endpoint' tests)."""
    import socket

    for port in PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")
