"""Spot/preemption notices (hvdtrain/fault/spot.py) against a real HTTP server on loopback that answers
as each cloud's metadata endpoint does: no notice, then a notice."""

from __future__ import annotations

import time

import pytest

from hvdtrain.config import ConfigError
from hvdtrain.fault.preemption import StopRequest
from hvdtrain.fault.spot import Aws, NoticeWatcher, Unreachable
from hvdtrain.job_config import load_config
from tests.metadata_server import AWS_TOKEN, free_port, metadata_server

NOTICES = {
    "aws": "an AWS spot interruption notice (terminate at 2026-11-23T04:12:00Z)",
    "azure": "an Azure Scheduled Events Preempt notice (C7061BAC-AFDC-4513-B24B-AA5F13A16123, "
             "not before Mon, 23 Nov 2026 04:12:30 GMT)",
    "gcp": "a GCP preemption notice (instance/preempted = TRUE)",
}


def wait_until(condition, timeout: float = 30) -> None:
    """Wait for ``condition()`` (an event: polls seen by the server, a notice taken), the timeout
    only a guard."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.01)


def polls(server) -> int:
    return sum(request[0] == "GET" for request in list(server.requests))


@pytest.mark.parametrize("cloud", ["aws", "azure", "gcp"])
def test_the_watcher_reports_each_clouds_notice_once(cloud):
    with metadata_server(cloud) as server:
        notices, said = [], []
        watcher = NoticeWatcher(cloud, server.url, 0.05, notices.append, said.append)
        assert watcher.poll_once() is None and watcher.poll_once() is None  # no notice yet, not an error
        watcher.start()
        wait_until(lambda: polls(server) >= 5)  # three polls of the watcher's own, each without a notice
        assert notices == [] and watcher.failures == 0
        server.notice.set()
        wait_until(lambda: notices)
        watcher._thread.join(30)  # a notice ends the polling: the thread returns by itself, unstopped
        assert not watcher._thread.is_alive()
        watcher.stop()
        assert notices == [NOTICES[cloud]]  # once, although the endpoint keeps saying so
        assert said == [f"hvdtrain: watching for {cloud} preemption notices at {server.url} every 0.05 s"]
        requests = list(server.requests)
    if cloud == "aws":
        # IMDSv2: one token (PUT with a TTL), then every GET carries it.
        puts = [r for r in requests if r[0] == "PUT"]
        assert len(puts) == 1 and puts[0][2]["x-aws-ec2-metadata-token-ttl-seconds"] == "21600"
        gets = [r for r in requests if r[0] == "GET"]
        assert len(gets) >= 3 and all(r[2]["x-aws-ec2-metadata-token"] == AWS_TOKEN for r in gets)
    if cloud == "azure":
        assert all(r[2]["metadata"] == "true" for r in requests)
        assert any(r[1].startswith("/metadata/scheduledevents?api-version=") for r in requests)
    if cloud == "gcp":
        assert all(r[2]["metadata-flavor"] == "Google" for r in requests)


def test_an_expired_aws_token_is_renewed_once():
    with metadata_server("aws") as server:
        aws = Aws(server.url)
        aws.token = "expired"
        server.notice.set()
        assert aws.check() == NOTICES["aws"]
        assert aws.token == AWS_TOKEN
        assert [r[0] for r in server.requests] == ["GET", "PUT", "GET"]


def test_an_azure_preempt_event_for_another_vm_is_not_ours():
    with metadata_server("azure") as server:
        from hvdtrain.fault.spot import Azure

        azure = Azure(server.url)
        azure.vm_name = "some-other-vm"
        server.notice.set()
        assert azure.check() is None  # the Preempt event names hvdtrain-node0; the Freeze is not a notice


@pytest.mark.parametrize("cloud", ["aws", "azure", "gcp"])
def test_an_unreachable_endpoint_is_said_once_and_never_blocks(cloud):
    url = f"http://127.0.0.1:{free_port()}"
    said = []
    watcher = NoticeWatcher(cloud, url, 0.05, lambda line: None, said.append, timeout=0.5).start()
    wait_until(lambda: watcher.failures >= 3)
    start = time.monotonic()
    watcher.stop()
    assert time.monotonic() - start < 2.0
    assert watcher.failures >= 3
    assert len(said) == 2 and said[1].startswith(f"hvdtrain: the {cloud} metadata endpoint does not answer (")
    assert said[1].endswith("polling it quietly every 0.05 s")


def test_a_server_that_is_not_the_clouds_is_unreachable():
    with metadata_server("aws") as server:  # answers 404 to GCP's path, and without Metadata-Flavor
        from hvdtrain.fault.spot import Gcp

        with pytest.raises(Unreachable, match="without Metadata-Flavor: Google"):
            Gcp(server.url).check()


def test_a_notice_becomes_the_same_stop_request_as_a_signal():
    with metadata_server("gcp") as server:
        stop = StopRequest("gcp", server.url, 0.05)
        server.notice.set()
        with stop.installed():
            wait_until(lambda: stop.received is not None)
        assert stop.reason() == NOTICES["gcp"]


@pytest.mark.parametrize("overrides, message", [
    (["runtime.preemption_notice=ibm"], "runtime.preemption_notice"),
    (["runtime.preemption_notice_url=http://127.0.0.1:27100"], "is set but runtime.preemption_notice=none"),
    (["runtime.preemption_notice=aws", "runtime.preemption_notice_url=169.254.169.254"], "expected an http://"),
    (["runtime.preemption_notice=gcp", "runtime.preemption_poll_seconds=0"], "must be positive"),
])
def test_bad_notice_keys_fail_with_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        load_config("debug", overrides)
    assert "\n" not in str(error.value)
