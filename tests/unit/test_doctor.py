"""The doctor's arithmetic and argument parsing (the launched parts: tests/multinode/test_doctor.py)."""

from __future__ import annotations

import pytest

from hvdtrain.tools.allreduce import bus_bandwidth
from hvdtrain.tools.doctor import (DoctorError, Host, compare_hosts, parse_hosts, parse_sizes,
                             read_hostfile)


def test_bus_bandwidth_follows_nccl_tests():
    # nccl-tests: busbw = algbw * 2(n-1)/n. 1 GB in 1 s over 8 ranks -> 1.75 GB/s; 2 ranks -> 1 GB/s.
    assert bus_bandwidth(10**9, 1.0, 8) == pytest.approx(1.75e9)
    assert bus_bandwidth(10**9, 0.5, 2) == pytest.approx(2e9)
    assert bus_bandwidth(10**9, 1.0, 1) == 0


def test_hosts_and_hostfiles(tmp_path):
    assert [(h.name, h.slots) for h in parse_hosts("node0:2,node1")] == [("node0", 2), ("node1", 1)]
    for bad in ("node0:x", "node0:0", ","):
        with pytest.raises(DoctorError):
            parse_hosts(bad)
    path = tmp_path / "hosts"
    path.write_text("# comment\nnode0 slots=4\n\nnode1 slots=4 max_slots=8  # trailing\nnode2\n")
    assert [(h.name, h.slots) for h in read_hostfile(path)] == [("node0", 4), ("node1", 4), ("node2", 1)]
    path.write_text("node0 slots=four\n")
    with pytest.raises(DoctorError, match="hosts:1: expected 'host slots=N'"):
        read_hostfile(path)
    with pytest.raises(DoctorError, match="cannot read hostfile"):
        read_hostfile(tmp_path / "missing")


def test_sizes():
    assert parse_sizes("1K,4M,100") == [1024, 4 << 20, 100]
    with pytest.raises(DoctorError, match="bad size 'lots'"):
        parse_sizes("1K,lots")


def facts(**changes):
    base = {"python": "3.11.7", "torch": "2.13.0", "horovod": "0.28.1", "hvdtrain": "0.1.0",
            "built": {"nccl": True, "gloo": True, "mpi": True}, "gpus": [], "interfaces": {"lo": [], "eth0": []}}
    return {**base, **changes}


def test_environment_differences_name_the_host():
    hosts = [Host("a", 1, facts()), Host("b", 1, facts(torch="2.12.0")), Host("c", 1, facts(),),
             Host("d", 1, problem="not reachable over ssh (Connection refused)")]
    hosts[2].facts["built"] = {"nccl": False, "gloo": True, "mpi": True}
    problems = compare_hosts(hosts)
    assert problems == [
        "d: not reachable over ssh (Connection refused)",
        "b: torch 2.12.0 differs from a's 2.13.0 (environments must match)",
        "c: built gloo+mpi differs from a's nccl+gloo+mpi (environments must match)",
    ]
    assert compare_hosts([Host("a", 1, facts()), Host("b", 1, facts())]) == []
    no_common = [Host("a", 1, facts(interfaces={"eth0": []})), Host("b", 1, facts(interfaces={"ib0": []}))]
    assert "no network interface name is common" in compare_hosts(no_common)[0]
