"""The liveness service on a shared network: silent connections from outside
cannot delay a peer's ping past the watchdog's bound, a connection without the job's token gets
no answer, and the service listens on the ranks' address only. Hung and dead peers are still
told apart (tests/parallel/test_fault_tolerance.py proves it under horovodrun and mpirun)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvdtrain.fault.liveness import LivenessService, Peer, listen_addresses, lost_peers, ping
from tests.helpers import REPO

PING_BOUND = 2.0  # the ping's own timeout, which lost_peers (the watchdog) waits for


def peer_of(service: LivenessService) -> Peer:
    return Peer(**service.describe())


def can_bind(address: str) -> bool:
    try:
        socket.create_server((address, 0)).close()
        return True
    except OSError:
        return False


@pytest.fixture
def service():
    service = LivenessService(1, ["127.0.0.1"])
    yield service
    if hasattr(service, "close"):
        service.close()


def test_silent_connections_from_outside_do_not_delay_a_ping(service):
    silent = [socket.create_connection(("127.0.0.1", service.port)) for _ in range(5)]
    try:
        time.sleep(0.05)
        start = time.monotonic()
        verdict = ping(peer_of(service), timeout=PING_BOUND)
        elapsed = time.monotonic() - start
        assert verdict == "alive", f"{verdict} after {elapsed:.2f}s"
        assert elapsed < 0.5, f"a ping took {elapsed:.2f}s behind 5 silent connections"
        # What the watchdog asks: nobody lost.
        assert lost_peers([peer_of(service), Peer(0, "me", [], 0, os.getpid())], own_rank=0) == []
    finally:
        for conn in silent:
            conn.close()


def test_many_slow_connections_cannot_starve_the_service(service):
    # More than the service keeps at once, each sending half a ping and then nothing.
    silent = []
    for _ in range(300):
        conn = socket.create_connection(("127.0.0.1", service.port))
        conn.sendall(b"hvdtrain-ping ")
        silent.append(conn)
    try:
        start = time.monotonic()
        assert ping(peer_of(service), timeout=PING_BOUND) == "alive"
        assert time.monotonic() - start < 0.5
    finally:
        for conn in silent:
            conn.close()


def exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=PING_BOUND) as conn:
        conn.sendall(request)
        reply = b""
        try:
            while chunk := conn.recv(256):
                reply += chunk
        except socket.timeout:
            pass
        return reply


def test_a_connection_without_the_token_gets_no_answer(service):
    assert exchange(service.port, b"hvdtrain-ping\n") == b""  # the old, open protocol
    assert exchange(service.port, b"hvdtrain-ping 0123456789abcdef " + b"0" * 64 + b"\n") == b""
    # A peer whose token is not this service's (another job's, a guess) hears nothing that counts.
    impostor = peer_of(service)
    impostor.token = os.urandom(32).hex()
    assert ping(impostor, timeout=PING_BOUND) == "no answer"
    assert ping(peer_of(service), timeout=PING_BOUND) == "alive"  # and the service still serves


def test_the_reply_proves_the_token_and_is_bound_to_the_ping(service):
    from hvdtrain.fault.liveness import PING, PONG, proof

    token = bytes.fromhex(peer_of(service).token)
    reply = exchange(service.port, PING + b"n1 " + proof(token, b"ping", b"n1") + b"\n")
    assert reply == PONG + b"1 " + proof(token, b"alive", b"n1", b"1") + b"\n"
    # The token itself never crosses the wire, and a recorded reply does not answer another nonce.
    assert token.hex().encode() not in reply
    assert reply != PONG + b"1 " + proof(token, b"alive", b"n2", b"1") + b"\n"


def test_the_service_listens_on_the_ranks_address_only():
    if not can_bind("127.0.0.2"):
        pytest.skip("cannot bind the loopback alias 127.0.0.2 here")
    service = LivenessService(0, ["127.0.0.2"])
    try:
        assert peer_of(service).addresses == ["127.0.0.2"]
        assert ping(peer_of(service)) == "alive"
        with pytest.raises(ConnectionRefusedError):  # the same port on another of this host's addresses
            socket.create_connection(("127.0.0.1", service.port), timeout=1).close()
    finally:
        service.close()


def test_the_token_is_not_printed_with_the_peer(service):
    peer = peer_of(service)
    assert len(peer.token) == 64 and peer.token not in repr(peer) and peer.token not in peer.label()


# --- where to listen ------------------------------------------------------------------------------

LO = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.1.0.5"], "ib0": ["192.168.7.5"]}


@pytest.mark.parametrize("env, one_host, first", [
    # horovodrun/hvdtrain ray name the interface; on lo the host name's alias wins (tests/multinode's node1).
    ({"HOROVOD_GLOO_IFACE": "eth0", "HOROVOD_HOSTNAME": "10.1.0.5"}, False, "10.1.0.5"),
    ({"HOROVOD_GLOO_IFACE": "ib0", "HOROVOD_HOSTNAME": "10.1.0.5"}, False, "192.168.7.5"),
    ({"HOROVOD_GLOO_IFACE": "lo", "HOROVOD_HOSTNAME": "127.0.0.3"}, False, "127.0.0.3"),
    ({"HOROVOD_GLOO_IFACE": "lo", "HOROVOD_HOSTNAME": "localhost"}, True, "127.0.0.1"),
    # horovodrun --mpi: btl_tcp_if_include (names or CIDR) and NCCL_SOCKET_IFNAME (prefixes).
    ({"OMPI_MCA_btl_tcp_if_include": "ib0"}, False, "192.168.7.5"),
    ({"OMPI_MCA_btl_tcp_if_include": "10.1.0.0/16"}, False, "10.1.0.5"),
    ({"NCCL_SOCKET_IFNAME": "eth"}, False, "10.1.0.5"),
    # Plain mpirun on one host: loopback.
    ({}, True, "127.0.0.1"),
])
def test_listen_address_is_the_one_the_ranks_use(env, one_host, first):
    assert listen_addresses(env, one_host, LO)[0] == first


def test_several_hosts_without_a_named_network_never_listen_on_loopback():
    # 127.0.1.1 is what Debian's /etc/hosts gives the host's own name: unreachable from the others.
    addresses = listen_addresses({"HOROVOD_HOSTNAME": "127.0.1.1"}, False, LO)
    assert not [a for a in addresses if a.startswith("127.") or a == "::1"]


def test_a_stopped_process_is_no_answer_and_a_dead_one_is_gone(tmp_path):
    """The watchdog's two verdicts, from a service in another process."""
    script = tmp_path / "serve.py"
    script.write_text(
        "import json, sys, time\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from hvdtrain.fault.liveness import LivenessService\n"
        "s = LivenessService(3, ['127.0.0.1'])\n"
        "print(json.dumps(s.describe()), flush=True)\n"
        "time.sleep(60)\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        import json

        peer = Peer(**json.loads(process.stdout.readline()))
        assert ping(peer) == "alive"
        os.kill(process.pid, signal.SIGSTOP)
        while Path(f"/proc/{process.pid}/stat").read_text().split(")")[1].split()[0] != "T":
            time.sleep(0.01)  # the signal is delivered asynchronously
        start = time.monotonic()
        assert ping(peer, timeout=1.0) == "no answer"
        assert time.monotonic() - start < 1.5
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
        assert ping(peer, timeout=1.0) == "gone"
    finally:
        process.kill()
        process.wait()


def test_a_finished_run_leaves_no_watchdog_or_liveness_thread():
    """A process may start another run after one ends (the Python API called twice, the suite's
    shared ranks): the run's release stops its watchdog and closes its liveness service."""
    import threading

    from hvdtrain.fault.watchdog import Watchdog

    before = set(threading.enumerate())
    service = LivenessService(0, ["127.0.0.1"])
    watchdog = Watchdog(30, [], 0)
    started = set(threading.enumerate()) - before
    assert {thread.name for thread in started} == {"hvdtrain-liveness", "hvdtrain-watchdog"}
    watchdog.stop()
    service.close()
    for thread in started:
        thread.join(timeout=10)  # each wakes at once: an event, the closed socket
        assert not thread.is_alive(), thread.name
