"""Training across two machines, node0 and node1, started over real ssh by horovodrun and mpirun.

Proof that the ranks ran "remotely": each node's own sshd logged a key login for the job, every
rank reports the layout a two-machine job has (rank r of 2, local rank 0, one rank per host),
and both ranks finish with identical parameters.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from .nodes import REPO, TwoNodes

PROBE = REPO / "tests" / "parallel" / "probe.py"


def probe_args(tiny_data: Path, tmp_path: Path) -> list[str]:
    return [str(PROBE), str(tmp_path / "probe"), "--config", "debug", f"data.dir={tiny_data}",
            f"output.dir={tmp_path / 'run'}", "train.epochs=1", "train.steps_per_epoch=3"]


def check_ranks(tmp_path: Path) -> list[dict]:
    ranks = [torch.load(tmp_path / "probe" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [(r["rank"], r["size"], r["local_rank"]) for r in ranks] == [(0, 2, 0), (1, 2, 0)]
    reference = ranks[0]["state"]
    for key, value in ranks[1]["state"].items():
        assert torch.equal(reference[key], value), f"{key} differs between node0 and node1"
    assert ranks[0]["step"] == ranks[1]["step"] == 3
    return ranks


def logins_since(nodes: TwoNodes, before: dict[str, int]) -> dict[str, int]:
    return {host: count - before[host] for host, count in nodes.accepted_logins().items()}


def test_plain_ssh_reaches_each_node_on_its_own_address(two_nodes):
    for host, address in two_nodes.addresses.items():
        result = two_nodes.ssh(host, "echo $SSH_CONNECTION")
        assert result.returncode == 0, result.stderr
        # SSH_CONNECTION = client address, client port, server address, server port
        assert result.stdout.split()[2:] == [address, str(two_nodes.ssh_port)]
    down = two_nodes.ssh(two_nodes.unreachable_host, "true")
    assert down.returncode == 255 and "refused" in down.stderr


@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovodrun_trains_across_two_nodes(controller, two_nodes, tiny_data, tmp_path):
    before = two_nodes.accepted_logins()
    result = two_nodes.horovodrun(probe_args(tiny_data, tmp_path), tmp_path, controller=controller)
    ranks = check_ranks(tmp_path)
    assert {r["controller"] for r in ranks} == {controller}
    if controller == "gloo":
        assert [r["launcher_env"]["HOROVOD_RANK"] for r in ranks] == ["0", "1"]
        assert [r["launcher_env"]["HOROVOD_LOCAL_RANK"] for r in ranks] == ["0", "0"]
    else:
        assert [r["launcher_env"]["OMPI_COMM_WORLD_RANK"] for r in ranks] == ["0", "1"]
        assert [r["launcher_env"]["OMPI_COMM_WORLD_LOCAL_RANK"] for r in ranks] == ["0", "0"]
    assert "2 ranks on 2 host(s)" in result.stdout
    logins = logins_since(two_nodes, before)
    assert logins["node0"] >= 1 and logins["node1"] >= 1, logins


def test_mpirun_with_a_hostfile_trains_across_two_nodes(two_nodes, tiny_data, tmp_path):
    hostfile = two_nodes.hostfile(tmp_path / "hosts", style="openmpi")
    before = two_nodes.accepted_logins()
    result = two_nodes.mpirun(probe_args(tiny_data, tmp_path), tmp_path, hostfile=hostfile)
    ranks = check_ranks(tmp_path)
    assert {r["controller"] for r in ranks} == {"mpi"}
    assert [r["launcher_env"]["OMPI_COMM_WORLD_RANK"] for r in ranks] == ["0", "1"]
    assert [r["launcher_env"]["OMPI_COMM_WORLD_LOCAL_RANK"] for r in ranks] == ["0", "0"]
    assert "2 ranks on 2 host(s)" in result.stdout
    # Open MPI starts one daemon per node over ssh: exactly one login on each.
    assert logins_since(two_nodes, before) == {"node0": 1, "node1": 1}


def test_host_discovery_script_lists_the_hosts_that_answer_ssh(two_nodes, tmp_path):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(f"# elastic hosts\nnode0 slots=2\nnode1:1\n{two_nodes.unreachable_host} slots=4\n")
    result = subprocess.run(["bash", str(REPO / "hostfiles" / "discover-hosts.sh")], capture_output=True,
                            text=True, env={**os.environ, "HVDTRAIN_HOSTS_FILE": str(hosts)}, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["node0:2", "node1:1"]  # node-down does not answer: left out


def test_a_block_left_by_a_crashed_run_is_removed_exactly():
    from .nodes import BEGIN, END, strip_block

    original = "127.0.0.1 localhost\n10.0.0.5 gpu01\n"
    stale = original + f"{BEGIN}\n127.0.0.2 node0\n{END}\n"
    assert strip_block(stale) == original
    assert strip_block(original) == original
