"""Rendezvous servers behind the job's token.

``hvdtrain ray``'s: it listens on the address the ranks reach it at, refuses every request
without the job's token (an outsider's PUT of a peer address used to be accepted), and Horovod's
own Gloo client, unchanged, still rendezvouses through it: two real ranks started with the
environment ``hvdtrain ray`` gives them allreduce. Ray is not needed: the server, the ranks'
environment and the ranks are the same pieces ``Job.start_ranks`` puts together.

horovodrun's (Gloo controller): the same refusal, from hvdtrain's Horovod patch
(third_party/horovod/0007-token-on-the-gloo-rendezvous-server.patch, installed by ``make setup``)."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys

import pytest

from hvdtrain.launch.ray import Placement, assign_ranks, rank_env, rendezvous_addr, start_rendezvous
from tests.helpers import BIN, job_env

ADDRESS = "127.0.0.1"
RANK = """
import horovod.torch as hvd, torch
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()}: sum {total.item():g}", flush=True)
"""


@pytest.fixture
def rendezvous():
    from horovod.runner.common.util.hosts import SlotInfo

    server, port = start_rendezvous(0, ADDRESS)
    slots = assign_ranks([Placement("a" * 8, ADDRESS, "lo", []), Placement("a" * 8, ADDRESS, "lo", [])])
    server.init([SlotInfo(s.host, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size)
                 for s in slots])
    yield server, port, slots
    server.stop()


def request(port: int, method: str, path: str, body: bytes | None = None) -> int:
    conn = http.client.HTTPConnection(ADDRESS, port, timeout=5)
    try:
        conn.request(method, path, body=body)
        return conn.getresponse().status
    finally:
        conn.close()


def test_an_outsiders_put_is_refused(rendezvous):
    server, port, _ = rendezvous
    # The key Gloo reads a peer's address from, without the token: refused, and nothing stored.
    assert request(port, "PUT", "/global/rank_0", b"10.6.6.6:1234") == 403
    assert request(port, "GET", "/global/rank_0") == 403
    assert request(port, "DELETE", "/global/0") == 403
    assert request(port, "PUT", f"/{'0' * 32}:{port}/global/rank_0", b"x") == 403  # a wrong token
    assert request(port, "HEAD", "/") == 403
    assert server._httpd.cache == {}
    # With the token, the same request is Horovod's as before.
    assert request(port, "PUT", f"/{server.token}:{port}/global/rank_0", b"x") == 200
    assert server._httpd.cache == {"global": {"rank_0": b"x"}}


def test_it_listens_on_the_ranks_address_only(rendezvous):
    _, port, _ = rendezvous
    try:
        socket.create_server(("127.0.0.2", 0)).close()
    except OSError:
        pytest.skip("no loopback alias 127.0.0.2 here")
    with pytest.raises(ConnectionRefusedError):  # the same port on another address of this machine
        socket.create_connection(("127.0.0.2", port), timeout=2).close()


def test_two_ranks_rendezvous_through_it_with_the_token_in_their_environment(rendezvous, tmp_path):
    server, port, slots = rendezvous
    gloo_addr = rendezvous_addr(ADDRESS, port, server.token)
    ranks = []
    for slot in slots:
        env = {**job_env(tmp_path), **rank_env(slot, "lo", gloo_addr, port, [])}
        ranks.append(subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = []
    for process in ranks:
        out, _ = process.communicate(timeout=120)
        outputs.append(out)
        assert process.returncode == 0, out
        assert server.token not in " ".join(process.args)  # never on a command line
    assert [line for out in outputs for line in out.splitlines() if line.startswith("rank")] == \
        ["rank 0 of 2: sum 3", "rank 1 of 2: sum 3"]


def test_a_rendezvous_address_that_is_not_this_machines_is_one_line():
    from hvdtrain.launch.ray import RayLaunchError

    with pytest.raises(RayLaunchError, match="give --rendezvous-addr an address of this machine"):
        start_rendezvous(0, "192.0.2.77")  # TEST-NET-1: never a local address


OUTSIDER = """
import http.client, os
import horovod.torch as hvd, torch
host, port = os.environ["HOROVOD_GLOO_RENDEZVOUS_ADDR"].split(":")[0], os.environ["HOROVOD_GLOO_RENDEZVOUS_PORT"]
hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
if hvd.rank() == 0:
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("PUT", "/global/rank_0", body=b"10.6.6.6:1234")
    print(f"outsider PUT: {conn.getresponse().status}", flush=True)
print(f"rank {hvd.rank()} of {hvd.size()}: sum {total.item():g}", flush=True)
"""


def test_horovodruns_own_rendezvous_refuses_requests_without_the_token(tmp_path):
    probe = tmp_path / "outsider.py"
    probe.write_text(OUTSIDER)
    env = job_env(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), env["PYTHONPATH"]]))
    result = subprocess.run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                             str(probe)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0 of 2: sum 3" in result.stdout and "rank 1 of 2: sum 3" in result.stdout
    assert "outsider PUT: 403" in result.stdout, result.stdout
