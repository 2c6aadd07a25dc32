"""comm/job_store.py, the torch engine's store, piece by piece (tests/parallel/test_store_security.py
launches the attacks for real): the job's secret is required, the store listens on MASTER_ADDR's
address alone, a port in use or a foreign address is one line, the handshake agrees on a key only
between processes that know the secret (and names the one that does not), and a value in the store
that none of the job's ranks signed is refused."""

from __future__ import annotations

import socket
import threading

import pytest
import torch.distributed as tdist

from hvdtrain.comm import job_store
from hvdtrain.config import ConfigError

SECRET = b"s" * 64
WHERE = "127.0.0.1:1"


@pytest.fixture(autouse=True)
def one_host(monkeypatch):
    """No launcher variable says the ranks span hosts (a test sets its own)."""
    for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES", "OMPI_COMM_WORLD_LOCAL_SIZE", "LOCAL_WORLD_SIZE",
                 "HOROVOD_CROSS_SIZE", "HOROVOD_LOCAL_SIZE"):
        monkeypatch.delenv(name, raising=False)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("value, says", [(None, "is not set"), ("short", "has 5 characters, fewer than 32")])
def test_the_job_secret_is_required_in_one_line(monkeypatch, value, says):
    if value is None:
        monkeypatch.delenv(job_store.SECRET_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(job_store.SECRET_VARIABLE, value)
    with pytest.raises(ConfigError) as caught:
        job_store.job_secret()
    line = str(caught.value)
    assert "\n" not in line and f"HVDTRAIN_JOB_SECRET {says}" in line and job_store.MAKE_SECRET in line
    monkeypatch.setenv(job_store.SECRET_VARIABLE, "x" * 32)
    assert job_store.job_secret() == b"x" * 32


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_the_store_listens_on_master_addr_alone(host):
    port = free_port()
    with job_store.listen(host, port) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)  # loopback, not 0.0.0.0


@pytest.mark.parametrize("other", ["127.0.0.1", "0.0.0.0"])
def test_a_port_in_use_is_one_line_naming_the_port_and_the_fix(other):
    with socket.socket() as taken:
        taken.bind((other, 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            job_store.listen("127.0.0.1", port)
    assert str(caught.value) == (f"MASTER_PORT={port} is in use on 127.0.0.1 (another job, or another process, "
                                 "listens there): export a free port as MASTER_PORT (or torchrun --master_port), "
                                 "one per job on a shared host")


@pytest.mark.parametrize("variables", [{"SLURM_JOB_NUM_NODES": "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                                       "OMPI_COMM_WORLD_SIZE": "4"}, {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "2"}])
def test_a_loopback_master_addr_for_ranks_on_several_hosts_is_one_line(monkeypatch, variables):
    # e.g. MASTER_ADDR=$(hostname) where /etc/hosts maps the name to 127.0.1.1: the other hosts never connect
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR=localhost is 127\.0\.0\.1 on rank 0's host, a loopback "):
        job_store.listen("localhost", free_port())


def test_torchrun_on_one_node_of_a_larger_allocation_may_meet_on_loopback(monkeypatch):
    """The launcher that started the ranks says where they run, not the allocation around it:
    torchrun --nproc_per_node 2 on the first node of a two-node Slurm allocation has both ranks on
    this host, so a loopback MASTER_ADDR reaches them all (the store once refused it, reading the
    node count first, where the loopback-name check did not)."""
    from hvdtrain.comm import launcher_env

    for name, value in {"SLURM_JOB_NUM_NODES": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    port = free_port()
    with job_store.listen("localhost", port) as sock:
        assert sock.getsockname() == ("127.0.0.1", port)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # one rank a node: the other is on the second node
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR=localhost is 127\.0\.0\.1 on rank 0's host, a loopback "):
        job_store.listen("localhost", free_port())
    assert job_store.spans_hosts is launcher_env.spans_hosts  # one answer for both loopback checks


def test_an_address_of_another_host_or_no_host_is_one_line():
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR=192\.0\.2\.1 \(192\.0\.2\.1\) is not an address of this host"):
        job_store.listen("192.0.2.1", free_port())
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR=no-such-host\.invalid does not resolve"):
        job_store.listen("no-such-host.invalid", free_port())


def handshake(secrets_by_rank: dict[int, bytes], before_rank_0=None) -> dict[int, object]:
    """Run the handshake on one in-memory store, a thread per rank (rank 0's started last, after
    ``before_rank_0(store)``): each rank's key or exception."""
    store, results = tdist.HashStore(), {}

    def rank(r: int) -> None:
        try:
            results[r] = job_store.authenticate(store, r, len(secrets_by_rank), secrets_by_rank[r], 20, WHERE)
        except Exception as error:  # noqa: BLE001 - the test reads it
            results[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in sorted(secrets_by_rank, reverse=True)]
    for thread in threads[:-1]:
        thread.start()
    if before_rank_0 is not None:
        before_rank_0(store)
    threads[-1].start()
    for thread in threads:
        thread.join(60)
    return results


def test_ranks_that_know_the_secret_agree_on_one_signing_key():
    results = handshake({0: SECRET, 1: SECRET, 2: SECRET})
    assert all(isinstance(key, bytes) and len(key) == 32 for key in results.values()), results
    assert len(set(results.values())) == 1


def test_a_rank_without_the_secret_is_refused_and_finds_the_store_is_not_its_own():
    results = handshake({0: SECRET, 1: b"t" * 64})
    assert isinstance(results[0], job_store.StoreRefused)
    assert f"joined the store at {WHERE} as rank 1 and could not prove the job's secret" in str(results[0])
    assert isinstance(results[1], job_store.StoreRefused)
    assert str(results[1]).startswith(f"the store at {WHERE} is not this job's (it could not prove the job's secret)")


def test_a_second_claim_of_a_rank_stops_every_rank_with_rank_0s_line():
    def intruder(store) -> None:  # claims rank 1 too, once the real rank 1 has
        store.wait([f"{job_store.AUTH}hello/1/1"])
        assert store.add(f"{job_store.AUTH}claims/1", 1) == 2

    results = handshake({0: SECRET, 1: SECRET}, before_rank_0=intruder)
    assert isinstance(results[0], job_store.StoreRefused)
    assert "claimed a rank already taken (2 claims)" in str(results[0])
    assert isinstance(results[1], job_store.StoreRefused) and str(results[1]) == str(results[0])


def test_a_value_nobody_signed_is_refused_never_used():
    inner = tdist.HashStore()
    signed = job_store.SignedStore(inner, b"k" * 32, WHERE)
    signed.set("rank_0", b"address")
    assert signed.get("rank_0") == b"address"
    inner.set("rank_1", b"an intruder's address")
    with pytest.raises(job_store.StoreRefused, match="'rank_1' in the store at 127.0.0.1:1 was not written by one"):
        signed.get("rank_1")
    inner.set("rank_0", inner.get("rank_0")[:-1] + b"!")  # a signed value changed
    with pytest.raises(job_store.StoreRefused):
        signed.get("rank_0")


def test_an_impostor_that_answers_and_decides_at_once_is_found_out_by_its_answer():
    """An impostor listening first answers rank 1's challenge and sets a verdict right after; the
    answer and the verdict may land between rank 1's two checks of the store. The answer is taken
    first, so rank 1 says the same thing however the two interleave."""
    class Racing(tdist.HashStore):
        def check(self, keys):  # the impostor writes both just after rank 1's look for the answer
            seen = super().check(keys)
            if keys == [f"{job_store.AUTH}answer/1/1"] and not seen and not self.written:
                self.written = True
                self.set(keys[0], '{"nonce": "n", "mac": "00"}')
                self.set(f"{job_store.AUTH}verdict", "not json")
            return seen

    store = Racing()
    store.written = False
    with pytest.raises(job_store.StoreRefused, match=r"is not this job's \(it could not prove the job's secret\)"):
        job_store.authenticate(store, 1, 2, SECRET, 20, WHERE)
