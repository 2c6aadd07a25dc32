"""Horovod patch 0009 (third_party/horovod/): horovodrun's Gloo rendezvous server clears a scope's
keys once that scope's own ranks are done with it, whatever the other scopes do. Each hvd.init()
writes the ranks' addresses into the global, local_HOST and cross_N scopes and says it is done with
each (a DELETE after the scope's barrier); keys a scope keeps are read by the job's next hvd.init()
(after hvd.shutdown()), whose ranks then connect to closed ports and abort.

The requests are the ones Gloo's HTTP store sends (horovod/common/gloo/http_store.cc), in an order
two ranks on a host produce: rank 0 finishes the local scope and its own cross_0 (size 1) before
rank 1 finishes the local scope."""

from __future__ import annotations

import http.client

import pytest

http_server = pytest.importorskip("horovod.runner.http.http_server")
hosts = pytest.importorskip("horovod.runner.common.util.hosts")

ADDRESS = "127.0.0.1"
LOCAL = "local_localhost"


@pytest.fixture
def server():
    """horovodrun's rendezvous server for 2 ranks on one host (scopes global, local_localhost,
    cross_0, cross_1), as gloo_run starts it."""
    rendezvous = http_server.RendezvousServer()
    port = rendezvous.start()
    rendezvous.init(hosts.get_host_assignments(hosts.parse_hosts("localhost:2"), 2))
    yield rendezvous, port
    rendezvous.stop()


def request(port: int, method: str, path: str, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection(ADDRESS, port, timeout=5)
    try:
        conn.request(method, path, body=body)
        return conn.getresponse().status
    finally:
        conn.close()


def rendezvous(port: int, scope: str, rank: int) -> None:
    """What one rank writes into a scope (Gloo's connectFullMesh: its host name, its addresses)."""
    assert request(port, "PUT", f"/{scope}/rank_{rank}", b"localhost") == 200
    assert request(port, "PUT", f"/{scope}/{rank}", f"127.0.0.1:{40000 + rank}".encode()) == 200


def done(port: int, scope: str, rank: int) -> None:
    assert request(port, "DELETE", f"/{scope}/{rank}") == 200


def keys(rendezvous_server, scope: str) -> list[str]:
    return sorted(rendezvous_server._httpd.cache.get(scope, {}))


def test_a_scope_is_cleared_when_its_own_ranks_are_done(server):
    rendezvous_server, port = server
    for init in range(3):  # hvd.init(), hvd.shutdown(), again: every init finds empty scopes
        for scope in ("global", LOCAL):
            rendezvous(port, scope, 0)
            rendezvous(port, scope, 1)
        done(port, "global", 0)
        done(port, "global", 1)
        done(port, LOCAL, 0)
        rendezvous(port, "cross_0", 0)
        done(port, "cross_0", 0)  # cleared every scope's count: rank 0's DELETE of local was lost
        done(port, LOCAL, 1)
        rendezvous(port, "cross_1", 1)
        done(port, "cross_1", 1)
        left = {scope: keys(rendezvous_server, scope) for scope in ("global", LOCAL, "cross_0", "cross_1")}
        assert left == {"global": [], LOCAL: [], "cross_0": [], "cross_1": []}, f"after init {init}"


def test_a_retried_delete_counts_once(server):
    """Gloo's store retries a request that failed (PerformHTTP): rank 0's second DELETE must not
    stand for rank 1, whose keys would otherwise stay for the next init."""
    rendezvous_server, port = server
    rendezvous(port, LOCAL, 0)
    rendezvous(port, LOCAL, 1)
    done(port, LOCAL, 0)
    done(port, LOCAL, 0)
    assert keys(rendezvous_server, LOCAL) == ["0", "1", "rank_0", "rank_1"]  # rank 1 is not done yet
    done(port, LOCAL, 1)
    assert keys(rendezvous_server, LOCAL) == []
