"""Two nodes in network namespaces over a rate-limited veth link (tests/multinode/netns.py).

What loopback cannot show: a link with a rate (tbf, measured with a socket test), names that
resolve per node (each its own hosts file and host name), a cable that can be pulled.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.helpers import PROBE, REFERENCE_ARGS, assert_matches_one_rank, launch, read_metrics, tiny

from .conftest import NET_RATE
from .netns import ADDRESSES, rate_bits


def test_the_link_runs_at_the_rate_it_was_set_to_and_each_node_is_its_own_machine(net_nodes):
    # tbf limits frames; TCP payload is 1448 of each 1514-byte frame (0.956): 239 of 250 Mbit/s.
    # An unlimited veth moves several Gbit/s here, so a missing tbf fails this by a factor >10.
    set_mbit = rate_bits(NET_RATE) / 1e6
    for direction, mbit in net_nodes.measured.items():
        assert 0.85 * set_mbit <= mbit <= 1.15 * set_mbit, (direction, mbit, set_mbit)
    seen = net_nodes.run("node0", ["sh", "-c", "hostname; taskset -pc $$; getent hosts node0 node1; "
                                   "ssh node1 'hostname; taskset -pc $$; echo $SSH_CONNECTION'"])
    assert seen.returncode == 0, seen.stderr
    lines = seen.stdout.splitlines()
    cores = net_nodes.state["cores"]
    assert lines[0] == "node0" and lines[1].endswith(f"affinity list: {cores['node0']}")
    assert [line.split() for line in lines[2:4]] == [[ADDRESSES["node0"], "node0"], [ADDRESSES["node1"], "node1"]]
    assert lines[4] == "node1" and lines[5].endswith(f"affinity list: {cores['node1']}")
    client, _, server, port = lines[6].split()  # ssh node1 went over the link, by name
    assert (client, server, port) == (ADDRESSES["node0"], ADDRESSES["node1"], "22")


def test_two_nodes_over_a_limited_link_reproduce_one_rank(net_nodes, tiny_data, tmp_path):
    before = net_nodes.accepted_logins()
    result = net_nodes.horovodrun([str(PROBE), str(tmp_path / "two")]
                                  + tiny(tiny_data, tmp_path / "run2", "train.batch_size=4", *REFERENCE_ARGS), tmp_path)
    assert "2 ranks on 2 host(s)" in result.stdout
    assert net_nodes.accepted_logins()["node1"] > before["node1"]  # node1's rank came over ssh
    launch("single", 1, [str(PROBE), str(tmp_path / "one")]
           + tiny(tiny_data, tmp_path / "run1", "train.batch_size=8", *REFERENCE_ARGS), tmp_path)
    assert_matches_one_rank(tmp_path / "one", tmp_path / "run1", tmp_path / "two", tmp_path / "run2")


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout:.0f}s")
        time.sleep(0.2)


@pytest.mark.timeout(900)
def test_a_pulled_link_names_the_lost_host_and_rank_exits_75_and_the_rerun_resumes(net_nodes, tiny_data, tmp_path):
    # The cable is pulled on node1's side (ip link set eth0 down) just after the first checkpoint,
    # and plugged back when the job has ended: rank 0's collective times out, it names node1's rank,
    # and the job exits 75 (resume me) with what was saved intact. The same command then resumes.
    timeout, epochs = 30, 12  # epochs: more than the ranks can train before the pull reaches them
    run_dir = tmp_path / "run"
    program = ["-m", "hvdtrain"] + tiny(tiny_data, run_dir, f"train.epochs={epochs}", "train.steps_per_epoch=2",
                                        f"dist.timeout_seconds={timeout}")
    cmd = net_nodes.prefix("node0", tmp_path) + net_nodes.horovodrun_argv(program, launch=True)
    job = subprocess.Popen(cmd, cwd=tmp_path, env=net_nodes.env(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    checkpoint = run_dir / "checkpoints" / "last.pt"
    try:
        wait_for(checkpoint.exists, 300, "first checkpoint")
        net_nodes.set_link(False)
        pulled = time.monotonic()
        try:
            output, _ = job.communicate(timeout=timeout + 90)
        finally:
            net_nodes.set_link(True)
        ended = time.monotonic() - pulled
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode == 75, output[-3000:]
    assert ended < timeout + 30, f"the job took {ended:.0f}s to end after the link went down"
    assert "lost rank 1 (node1, pid" in output, output[-3000:]
    assert "hvdtrain launch: exit 75" in output.splitlines()[-1], output[-3000:]

    rerun = net_nodes.run("node0", cmd[len(net_nodes.prefix("node0", tmp_path)):], cwd=tmp_path,
                          env=net_nodes.env(tmp_path), timeout=600)
    assert rerun.returncode == 0, (rerun.stdout + rerun.stderr)[-3000:]
    assert "resumed from" in rerun.stdout + rerun.stderr
    # The epochs trained before the pull are kept; the rerun (attempt 1) trains the rest, once each.
    validated = [(r["epoch"], r["step"], r["attempt"]) for r in read_metrics(run_dir) if r["split"] == "val"]
    kept = sum(1 for *_, attempt in validated if attempt == 0)
    assert 1 <= kept < epochs and validated == [(epoch, 2 * epoch + 2, 0 if epoch < kept else 1)
                                                for epoch in range(epochs)], \
        validated
