"""Two nodes in network namespaces over a rate-limited veth link (tests/multinode/netns.py).

What loopback cannot show: a link with a rate (tbf, measured with a socket test), names that
resolve per node (each its own hosts file and host name), a cable that can be pulled.
"""

from __future__ import annotations

from tests.helpers import PROBE, REFERENCE_ARGS, assert_matches_one_rank, launch, tiny

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
