"""runtime.cpu_affinity's decisions (hvdtrain/launch/placement.py); the binding of real launches is in
tests/parallel/test_placement.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hvdtrain.launch import placement


@pytest.mark.parametrize("cores, size, blocks", [
    ([0, 1], 2, [[0], [1]]),
    ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
    ([4, 5, 6, 7, 8, 9, 10, 11], 4, [[4, 5], [6, 7], [8, 9], [10, 11]]),
    ([3], 1, [[3]]),
])
def test_the_cores_split_in_order_by_local_rank(cores, size, blocks):
    assert [placement.split_cores(cores, rank, size) for rank in range(size)] == blocks


def fake_sysfs(root, cpus: dict[int, tuple[int, int, int]]):
    """/sys/devices/system/cpu with cpu -> (NUMA node, package, core id)."""
    for cpu, (node, package, core) in cpus.items():
        topology = root / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (root / f"cpu{cpu}" / f"node{node}").mkdir()
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return root


def test_blocks_hold_whole_cores_on_one_numa_node(tmp_path):
    # Linux numbers the second hyperthread of every core after the first ones: on one 4-core package
    # CPUs 0-3 and 4-7 are siblings. Halving 0..7 in numeric order would give each rank half a core
    # of every core; in topology order each rank gets 2 whole cores.
    sysfs = fake_sysfs(tmp_path / "smt", {cpu: (0, 0, cpu % 4) for cpu in range(8)})
    order = placement.topology_order(list(range(8)), sysfs)
    assert [sorted(placement.split_cores(order, rank, 2)) for rank in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # Two sockets, one NUMA node each, with hyperthreads: 4 ranks, each on 2 whole cores of one node.
    two = {cpu: (cpu // 4 % 2, cpu // 4 % 2, cpu % 4) for cpu in range(16)}
    order = placement.topology_order(list(range(16)), fake_sysfs(tmp_path / "numa", two))
    blocks = [sorted(placement.split_cores(order, rank, 4)) for rank in range(4)]
    assert blocks == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]


def test_without_topology_the_order_is_numeric(tmp_path):
    assert placement.topology_order([3, 1, 2], tmp_path) == [1, 2, 3]


@pytest.fixture
def host(monkeypatch, tmp_path):
    """Two local ranks on host "a" (this one is local rank 1) and what the other ranks report."""
    bound = []
    seen = {"everyone": []}
    monkeypatch.setattr(placement, "CPU_SYSFS", tmp_path)  # no topology: numeric order
    monkeypatch.setattr(placement.launcher, "host_name", lambda: "a")
    monkeypatch.setattr(placement.dist, "local_rank", lambda: 1)
    monkeypatch.setattr(placement.dist, "local_size", lambda: 2)

    def allgather(obj, name=None):
        if name == "hvdtrain.cpu_affinity":  # (host, pid, cores) of every rank
            return [(other, 100 + index, cores) for index, (other, cores) in enumerate(seen["everyone"])]
        return [obj]  # the choice: this rank's, as its host's first rank's
    monkeypatch.setattr(placement.dist, "allgather_object", allgather)
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(placement, "online_cpus", lambda sysfs=None: {0, 1, 2, 3})
    monkeypatch.setattr(placement, "bound_processes", lambda ours, online: seen.get("others", {}))
    monkeypatch.delenv("SLURM_CPUS_ON_NODE", raising=False)
    monkeypatch.setattr(placement, "bind_threads", bound.append)
    return seen, bound


def test_ranks_started_on_the_same_cores_take_a_block_each(host):
    seen, bound = host
    seen["everyone"] = [("a", [0, 1, 2, 3]), ("a", [0, 1, 2, 3]), ("b", [0, 5])]  # host b: not ours
    assert placement.place_rank("auto", "cpu", elastic=False) == [2, 3]
    assert bound == [[2, 3]]


@pytest.mark.parametrize("mode, device, elastic, everyone", [
    ("none", "cpu", False, None),
    ("auto", "cuda", False, None),
    ("auto", "cpu", True, None),
    ("auto", "cpu", False, [("a", [0, 1]), ("a", [0, 1, 2, 3])]),  # bound by the launcher
    ("rank", "cpu", False, [("a", [0, 1]), ("a", [0, 1, 2, 3])]),
])
def test_threads_stay_where_they_were(host, mode, device, elastic, everyone):
    seen, bound = host
    seen["everyone"] = everyone  # None: no collective may run
    assert placement.place_rank(mode, device, elastic) is None
    assert bound == []


def test_bind_threads_moves_the_threads_already_running():
    code = ("import json, os, threading, time; from hvdtrain.launch.placement import bind_threads; "
            "core = min(os.sched_getaffinity(0)); stop = threading.Event(); "
            "worker = threading.Thread(target=stop.wait); worker.start(); bind_threads([core]); "
            "print(json.dumps({t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir('/proc/self/task')})); "
            "stop.set()")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    threads = json.loads(result.stdout)
    assert len(threads) >= 2 and len({tuple(cores) for cores in threads.values()}) == 1
    assert len(next(iter(threads.values()))) == 1


def test_another_jobs_bound_ranks_keep_their_cores(host, monkeypatch):
    """Two jobs on one host, outside cgroups: the second binds within the cores nobody else is bound
    to, and leaves binding off, with one line, where too few remain (both jobs used to bind
    their ranks to the same cores)."""
    seen, bound = host
    logged = []
    monkeypatch.setattr(placement.dist, "log", logged.append)
    seen["everyone"] = [("a", [0, 1, 2, 3]), ("a", [0, 1, 2, 3])]
    seen["others"] = {4242: {0}}  # one core taken: three left for two ranks
    assert placement.place_rank("auto", "cpu", elastic=False) == [3]
    assert bound == [[3]] and logged == []
    seen["others"] = {4242: {0, 1}, 4243: {2}}
    assert placement.place_rank("auto", "cpu", elastic=False) is None
    assert len(logged) == 1 and logged[0].startswith("hvdtrain: a: CPU binding off: other processes on this host "
                                                     "are bound to CPUs 0-2 (e.g. pid 4242")
    # rank forces it: within the cores the job was started on
    assert placement.place_rank("rank", "cpu", elastic=False) == [2, 3]


@pytest.mark.parametrize("slurm_cpus, cores", [("2", None), ("4", [2, 3]), ("", [2, 3])])
def test_a_slurm_job_with_part_of_an_unbound_node_leaves_binding_off(host, monkeypatch, slurm_cpus, cores):
    seen, bound = host
    logged = []
    monkeypatch.setattr(placement.dist, "log", logged.append)
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", slurm_cpus)
    seen["everyone"] = [("a", [0, 1, 2, 3]), ("a", [0, 1, 2, 3])]
    assert placement.place_rank("auto", "cpu", elastic=False) == cores
    if cores is None:
        assert len(logged) == 1 and "Slurm gave this job 2 of the host's 4 CPUs but did not bind it" in logged[0]
        assert placement.place_rank("rank", "cpu", elastic=False) == [2, 3]


def test_a_single_rank_on_a_host_is_left_unbound_unless_asked():
    # auto: nothing to keep apart (its own helper threads would share its compute's cores)
    assert placement.choose_cores("auto", [0, 1, 2, 3], {0, 1, 2, 3}, {}, None, 1) == (None, "")
    assert placement.choose_cores("rank", [0, 1, 2, 3], {0, 1, 2, 3}, {}, None, 1) == ([0, 1, 2, 3], "")
    # a launcher's narrower binding stays what it is
    assert placement.choose_cores("auto", [2, 3], {0, 1, 2, 3}, {}, None, 1) == ([2, 3], "")


@pytest.mark.parametrize("started_on, others, slurm, expected", [
    ([0, 1, 2, 3], {}, None, [0, 1, 2, 3]),          # alone on the host: every core
    ([2, 3], {9: {0, 1}}, None, [2, 3]),             # a cpuset/taskset narrower than the host: the job's own
    ([0, 1, 2, 3], {9: {1}}, None, [0, 2, 3]),       # another job's rank on core 1: left to it
    ([0, 1, 2, 3], {9: {1, 2, 3}}, None, None),      # one core left for two ranks: off
    ([0, 1, 2, 3], {}, 2, None),                     # Slurm: 2 of 4 CPUs, unbound: off
    ([0], {}, None, None),                           # fewer cores than ranks
])
def test_choose_cores(started_on, others, slurm, expected):
    cores, reason = placement.choose_cores("auto", started_on, {0, 1, 2, 3}, others, slurm, 2)
    assert cores == expected
    assert bool(reason) == (expected is None and len(started_on) >= 2)


def test_bound_processes_finds_a_process_bound_to_part_of_the_host():
    online = placement.online_cpus()
    if len(online) < 2:
        pytest.skip("needs 2 CPUs")
    core = min(online)
    child = subprocess.Popen([sys.executable, "-c", f"import os, sys; os.sched_setaffinity(0, {{{core}}}); "
                              "print(flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        child.stdout.readline()  # bound by now
        found = placement.bound_processes(set(), online)
        assert found.get(child.pid) == {core}
        assert child.pid not in placement.bound_processes({child.pid}, online)  # one of ours
    finally:
        child.stdin.close()
        child.wait()


def test_online_cpus_and_ranges(tmp_path):
    (tmp_path / "online").write_text("0-3,8,10-11\n")
    assert placement.online_cpus(tmp_path) == {0, 1, 2, 3, 8, 10, 11}
    assert placement.cpu_ranges({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
