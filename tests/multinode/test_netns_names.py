"""A node whose own name resolves to a loopback address (Debian's ``127.0.1.1 <hostname>``), on the
namespaced nodes: node1's hosts file gets that line on top, as Debian's installer writes it.

Gloo, left to find its address by the host's name, would give the other hosts 127.0.1.1 to connect
to. hvdtrain names the host, the address and the fix in one line before any rank connects. Where
torch's Gloo is told the interface (GLOO_SOCKET_IFNAME), the name does not matter; Horovod's Gloo
connects to the name's address even with HOROVOD_GLOO_IFACE set.
"""

from __future__ import annotations

import subprocess

import pytest

from tests.helpers import BIN, tiny

from .netns import MEASURE_PORT

LOOPBACK = ["127.0.1.1 node1"]
LINE = ("this host's name 'node1' resolves to the loopback address 127.0.1.1 (/etc/hosts), so Gloo would give "
        "the other hosts an address they cannot reach")


def torchrun(nodes, node_rank: int, program: list[str], tmp_path) -> list[str]:
    return nodes.prefix(f"node{node_rank}", tmp_path) + [
        str(BIN / "python"), "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
        "--nproc_per_node", "1", "--master_addr", "node0", "--master_port", str(MEASURE_PORT + 1), *program]


@pytest.mark.timeout(600)
def test_torch_engine_names_a_loopback_host_name_before_connecting(net_nodes, tiny_data, tmp_path):
    program = ["-m", "hvdtrain"] + tiny(tiny_data, tmp_path / "run", "dist.engine=torch", "train.epochs=1")
    with net_nodes.hosts_lines("node1", LOOPBACK):
        first = subprocess.Popen(torchrun(net_nodes, 0, program, tmp_path), cwd=tmp_path, env=net_nodes.env(tmp_path),
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            second = subprocess.run(torchrun(net_nodes, 1, program, tmp_path), cwd=tmp_path,
                                    env=net_nodes.env(tmp_path), capture_output=True, text=True, timeout=300)
        finally:
            first.kill()  # rank 0 waits for a peer that will not come
            first.communicate()
    output = second.stdout + second.stderr
    assert second.returncode != 0
    assert LINE in output, output[-3000:]
    assert "export GLOO_SOCKET_IFNAME=eth0" in output
    assert "IoException" not in output and "connect [127.0.1.1]" not in output


@pytest.mark.timeout(600)
def test_horovod_engine_names_a_loopback_host_name_before_connecting(net_nodes, tiny_data, tmp_path):
    # horovodrun sets HOROVOD_GLOO_IFACE=eth0 on every rank, yet Horovod's Gloo on node1 still gives
    # 127.0.1.1 to node0 (measured: "gloo::IoException ... connect [127.0.1.1]:N: Connection refused",
    # exit 134, plain Horovod as well): the rank on node1 must stop first, with the line.
    with net_nodes.hosts_lines("node1", LOOPBACK):
        name = net_nodes.run("node1", ["getent", "hosts", "node1"])
        assert name.stdout.split()[0] == "127.0.1.1"
        result = net_nodes.horovodrun(["-m", "hvdtrain"] + tiny(tiny_data, tmp_path / "run", "train.epochs=1"),
                                      tmp_path, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert LINE in output, output[-3000:]
    assert "IoException" not in output and "Exit code: 134" not in output


def test_doctor_names_the_host_whose_name_is_on_loopback(net_nodes, tmp_path):
    with net_nodes.hosts_lines("node1", LOOPBACK):
        result = net_nodes.run("node0", [str(BIN / "python"), "-m", "hvdtrain", "doctor", "-H", "node0:1,node1:1",
                                         "--skip-bench"], cwd=tmp_path, env=net_nodes.env(tmp_path), timeout=300)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"node1: {LINE}" in result.stderr, result.stderr
    assert "node0: this host's name" not in result.stderr  # node0's name is on the link
