"""The doctor's arithmetic, argument parsing, interface choice, messages and deadline, and its
allreduce launch inside a Slurm allocation with a stand-in srun (the launched parts:
tests/multinode/test_doctor.py)."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import psutil
import pytest

from hvdtrain.comm import launcher_env as launcher
from hvdtrain.tools import allreduce, allreduce_slurm, doctor, process
from hvdtrain.tools.allreduce import bus_bandwidth, print_bandwidth, reached, read_steps, stall_message
from hvdtrain.tools.doctor import (
    DoctorError,
    Host,
    compare_hosts,
    interface_line,
    parse_hosts,
    parse_sizes,
    pick_interface,
    read_hostfile,
)
from hvdtrain.tools.process import run_with_deadline


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


# --- interfaces: which one connects the hosts --------------------------------------------------
def on(address: str, **interfaces: list[str]) -> Host:
    host = Host(address, 1, facts(interfaces=interfaces))
    host.address = address
    return host


def test_interface_whose_subnet_holds_the_other_hosts_is_picked():
    # The two-node harness: both "machines" are this box, node0/node1 resolve to 127.0.0.2/3.
    harness = [on("127.0.0.2", lo=["127.0.0.1/8"], eth0=["192.0.2.2/24"]),
               on("127.0.0.3", lo=["127.0.0.1/8"], eth0=["192.0.2.2/24"])]
    assert pick_interface(harness) == ("lo", ["eth0", "lo"])
    assert interface_line(*pick_interface(harness)).startswith(
        "to pin the network: horovodrun --network-interfaces lo ... and NCCL_SOCKET_IFNAME=lo ")
    # A cluster: the names resolve on eth0; docker0 and ib0 are shared too (docker0's subnet is
    # the same on every host but holds no host's address).
    cluster = [on("10.0.0.1", lo=["127.0.0.1/8"], eth0=["10.0.0.1/24"], docker0=["172.17.0.1/16"],
                  ib0=["10.1.0.1/16"]),
               on("10.0.0.2", lo=["127.0.0.1/8"], eth0=["10.0.0.2/24"], docker0=["172.17.0.1/16"],
                  ib0=["10.1.0.2/16"])]
    assert pick_interface(cluster) == ("eth0", ["docker0", "eth0", "ib0"])
    assert "--network-interfaces eth0 ... and NCCL_SOCKET_IFNAME=eth0" in interface_line(*pick_interface(cluster))
    # One interface besides loopback: nothing to pin, no line (the bench still names eth0).
    plain = [on("10.0.0.1", lo=["127.0.0.1/8"], eth0=["10.0.0.1/24"]),
             on("10.0.0.2", lo=["127.0.0.1/8"], eth0=["10.0.0.2/24"])]
    assert pick_interface(plain) == ("eth0", ["eth0"])
    assert interface_line(*pick_interface(plain)) is None
    # Routed between subnets: no subnet holds the other host; list the choices instead.
    routed = [on("10.0.0.1", eth0=["10.0.0.1/24"], ib0=["10.1.0.1/24"]),
              on("10.0.5.1", eth0=["10.0.5.1/24"], ib0=["10.1.5.1/24"])]
    assert pick_interface(routed) == (None, ["eth0", "ib0"])
    assert interface_line(*pick_interface(routed)) == (
        "the hosts share eth0, ib0: pin the one that connects them, horovodrun --network-interfaces IFACE ... "
        "and NCCL_SOCKET_IFNAME=IFACE")
    # Facts without subnets (an older hvdtrain on a host) and a host that did not resolve: no guess.
    assert pick_interface([on("10.0.0.1", eth0=["10.0.0.1"]), on("10.0.0.2", eth0=["10.0.0.2"])]) == (None, ["eth0"])
    unresolved = on("10.0.0.2", eth0=["10.0.0.2/24"])
    unresolved.address = None
    assert pick_interface([on("10.0.0.1", eth0=["10.0.0.1/24"]), unresolved]) == (None, [])


# --- the host's own name -----------------------------------------------------------------------
def test_hostname_that_does_not_resolve_is_a_problem_naming_the_host(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "box-7")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 0, 0, "", ("10.0.0.7", 0))])
    assert launcher.hostname_problem() is None

    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    problem = launcher.hostname_problem()
    assert problem == ("this host's name 'box-7' does not resolve (Horovod's Gloo controller would crash with a "
                       "segfault): add '127.0.1.1 box-7' to /etc/hosts or fix DNS")
    hosts = [Host("a", 1, facts(hostname_problem=None)), Host("b", 1, facts(hostname_problem=problem))]
    assert compare_hosts(hosts) == [f"b: {problem}"]


# --- the table ---------------------------------------------------------------------------------
def test_gpu_column_is_named_after_nccl_and_comes_once(capsys):
    sizes = [1 << 20, 64 << 20]
    results = [{"controller": "gloo", "size": 2, "sizes": sizes,
                "seconds": {"cpu": [0.01, 0.5], "cuda": [0.001, 0.01]}},
               {"controller": "mpi", "size": 2, "sizes": sizes, "seconds": {"cpu": [0.02, 0.25]}}]
    assert print_bandwidth(results) == "nccl/gpu"
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.strip().startswith("size"))
    assert header.split() == ["size", "gloo/cpu", "mpi/cpu", "nccl/gpu"]
    # busbw over 2 ranks = size / time: 64 MiB in 10 ms -> 6.711 GB/s. Four significant digits,
    # so that a small, slow size never reads 0.000 (a loaded CI host measured one that way).
    assert lines[-2].split() == ["64", "MiB", "0.1342", "0.2684", "6.711"]
    assert lines[-3].split() == ["1", "MiB", "0.1049", "0.05243", "1.049"]
    assert lines[-1] == "fastest at 64 MiB: nccl/gpu (6.711 GB/s)"


# --- how far a stuck launch got ----------------------------------------------------------------
def test_what_a_stuck_launch_reached():
    hosts = [Host("node0", 2), Host("node1", 1)]
    sizes = [4096, 262144, 4 << 20]

    def steps(*lines: str) -> dict:
        return read_steps("\n".join(lines))

    assert reached(hosts, steps("Checking ssh on all remote hosts."), sizes).startswith("no rank started")
    assert reached(hosts, steps("[1,0]<stdout>:HVDTRAIN_DOCTOR_STEP 0 started", "HVDTRAIN_DOCTOR_STEP 1 started"),
                   sizes) == "ranks started on node0 but never on node1"
    started = ["[0]<stdout>:HVDTRAIN_DOCTOR_STEP 0 started", "[1]<stdout>:HVDTRAIN_DOCTOR_STEP 1 started",
               "[2]<stdout>:HVDTRAIN_DOCTOR_STEP 2 started"]
    assert reached(hosts, steps(*started, "HVDTRAIN_DOCTOR_STEP 0 joined", "HVDTRAIN_DOCTOR_STEP 1 joined"), sizes) == (
        "ranks started on node0, node1 but Horovod's init never returned on node1 "
        "(the ranks could not connect to each other)")
    joined = [f"HVDTRAIN_DOCTOR_STEP {rank} joined" for rank in range(3)]
    assert reached(hosts, steps(*started, *joined), sizes) == "ranks started on node0, node1 but no allreduce finished"
    # Rank 2 has not finished 256 KiB yet; two ranks' output on one line still counts.
    progress = ["HVDTRAIN_DOCTOR_STEP 0 cpu:4096HVDTRAIN_DOCTOR_STEP 1 cpu:4096", "HVDTRAIN_DOCTOR_STEP 2 cpu:4096",
                "HVDTRAIN_DOCTOR_STEP 0 cpu:262144", "HVDTRAIN_DOCTOR_STEP 1 cpu:262144"]
    assert reached(hosts, steps(*started, *joined, *progress), sizes) == (
        "ranks started on node0, node1; allreduce finished up to 4 KiB on cpu, not 256 KiB on cpu")
    cpu_done = [f"HVDTRAIN_DOCTOR_STEP {rank} cpu:{size}" for rank in range(3) for size in sizes]
    assert reached(hosts, steps(*started, *joined, *cpu_done), sizes, ["cpu", "cuda"]) == (
        "ranks started on node0, node1; allreduce finished up to 4 MiB on cpu, not 4 KiB on gpu")
    what = "ranks started on node0, node1 but no allreduce finished"
    assert stall_message("mpi", 90, what, ["cpu"], None, "lo", ["eth0", "lo"]) == (
        f"mpi controller: no result within 90s: {what}; try --network-interfaces lo, or --controllers gloo")
    assert stall_message("gloo", 90, what, ["cpu", "cuda"], "eth0", "ib0", ["eth0", "ib0"]).endswith(
        "try --network-interfaces ib0 and NCCL_SOCKET_IFNAME=ib0, or --controllers mpi")
    assert stall_message("mpi", 90, what, ["cpu"], None, None, ["eth0", "ib0"]).endswith(
        "try --network-interfaces IFACE (one of eth0, ib0), or --controllers gloo")


# --- the deadline ends the whole launch ---------------------------------------------------------
FAKE_LAUNCHER = r'''
import os, signal, subprocess, sys, time
sleeper = [sys.executable, "-c", "import signal, sys, time; "
           "signal.signal(signal.SIGTERM, signal.SIG_IGN) if sys.argv[1] == 'stubborn' else None; time.sleep(600)"]
# Like mpirun's ssh clients: a process group of its own; this one ignores SIGTERM.
group = subprocess.Popen(sleeper + ["stubborn"], process_group=0)
# Like horovodrun's middlemen: a session of its own.
session = subprocess.Popen(sleeper + ["plain"], start_new_session=True)
# An orphan: its parent is gone, init adopted it; it stays in the launch's session.
orphan = subprocess.run(["/bin/sh", "-c", " ".join(sleeper[:2]) + ' "$0" plain >/dev/null 2>&1 & echo $!',
                         sleeper[2]], capture_output=True, text=True).stdout.strip()
with open(sys.argv[1], "w") as pids:
    pids.write(" ".join(map(str, [os.getpid(), group.pid, session.pid, orphan])))
for rank in (0, 1):
    print(f"[{rank}]<stdout>:HVDTRAIN_DOCTOR_STEP {rank} started", flush=True)
    print(f"[{rank}]<stdout>:HVDTRAIN_DOCTOR_STEP {rank} joined", flush=True)
time.sleep(600)  # the two children above hold this stdout open too
'''


def test_deadline_ends_the_launch_and_everything_it_started(tmp_path, monkeypatch):
    script, pid_file = tmp_path / "fake_horovodrun.py", tmp_path / "pids"
    script.write_text(FAKE_LAUNCHER)
    monkeypatch.setattr(allreduce, "bench_command", lambda *args: [sys.executable, str(script), str(pid_file)])
    args = argparse.Namespace(bench_timeout=3)
    start = time.monotonic()
    result, error = allreduce.run_bench("mpi", [Host("node0", 1), Host("node1", 1)], args, [4096],
                                        interface=None, chosen="lo", choices=["eth0", "lo"])
    took = time.monotonic() - start
    assert result is None
    assert error == ("mpi controller: no result within 3s: ranks started on node0, node1 but no allreduce "
                     "finished; try --network-interfaces lo, or --controllers gloo")
    # deadline + SIGTERM's grace (the stubborn one needs SIGKILL) + slack for a busy machine
    assert took < 3 + process.GRACE_SECONDS + 5, took
    pids = [int(pid) for pid in pid_file.read_text().split()]
    assert len(pids) == 4
    deadline = time.monotonic() + 5  # init reaps the adopted ones on its own schedule
    while time.monotonic() < deadline and [p for p in pids if alive(p)]:
        time.sleep(0.1)
    assert [p for p in pids if alive(p)] == []


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_launch_that_ends_in_time_is_read_whole(tmp_path):
    finished = run_with_deadline([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); "
                                  "sys.exit(3)"], 30)
    assert (finished.returncode, finished.stdout, finished.stderr, finished.timed_out) == (3, "out\n", "err\n", False)


# --- inside a Slurm allocation: the ranks as an srun step --------------------------------------
def slurm_args(**changes) -> argparse.Namespace:
    base = dict(sizes="4K,1M", iters=0, warmup=2, bench_timeout=90, slurm=True)
    return argparse.Namespace(**{**base, **changes})


def test_the_allreduce_step_is_an_srun_of_the_allocation(monkeypatch):
    hosts = [Host("gpu01", 4), Host("gpu02", 4)]
    monkeypatch.delenv("SRUN_MPI", raising=False)
    tail = [sys.executable, "-m", "hvdtrain", "doctor", "--bench", "--sizes", "4K,1M", "--iters", "0", "--warmup", "2",
            "--devices", "cpu", "--bench-timeout", "90"]
    assert allreduce_slurm.srun_bench_command("mpi", hosts, slurm_args(), ["cpu"]) == [
        "srun", "--overlap", "--nodes=2", "--ntasks=8", "--nodelist=gpu01,gpu02", "--distribution=block",
        "--cpus-per-task=1", "--immediate=20", "--kill-on-bad-exit=1", "--mpi=pmix", "--ntasks-per-node=4", *tail]
    monkeypatch.setenv("SRUN_MPI", "pmi2")  # train.sbatch's knob
    uneven = allreduce_slurm.srun_bench_command("mpi", [Host("a", 2), Host("b", 1)], slurm_args(bench_timeout=30),
                                                ["cpu"])
    assert "--mpi=pmi2" in uneven and "--immediate=10" in uneven and not any("per-node" in a for a in uneven)
    assert "--mpi=none" in allreduce_slurm.srun_bench_command("gloo", hosts, slurm_args(), ["cpu"])
    # The step's environment: what described the doctor's own step is left out, the controller's added.
    for key, value in {"PMIX_RANK": "0", "SLURM_NTASKS_PER_NODE": "1", "HOROVOD_RANK": "3", "KEEP_ME": "1"}.items():
        monkeypatch.setenv(key, value)
    env = allreduce_slurm.srun_env("gloo", hosts, ["cpu"], None, ("10.0.0.9", 4321, "t0k"), "ib0")
    assert {k: env.get(k) for k in ("PMIX_RANK", "SLURM_NTASKS_PER_NODE", "HOROVOD_RANK", "KEEP_ME")} == {
        "PMIX_RANK": None, "SLURM_NTASKS_PER_NODE": None, "HOROVOD_RANK": None, "KEEP_ME": "1"}
    assert (env["HOROVOD_CONTROLLER"], env["HOROVOD_GLOO_RENDEZVOUS_ADDR"], env["HOROVOD_GLOO_RENDEZVOUS_PORT"],
            env["HOROVOD_GLOO_IFACE"], env[allreduce_slurm.SLOTS_VARIABLE]) == (
        "gloo", "10.0.0.9:4321/t0k", "4321", "ib0", "gpu01:4,gpu02:4")
    env = allreduce_slurm.srun_env("mpi", hosts, ["cpu"], "ib0", None)
    assert env["HOROVOD_CONTROLLER"] == "mpi" and env["OMPI_MCA_btl_tcp_if_include"] == "ib0"
    assert "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in env


def test_each_gloo_task_finds_its_place_in_the_plan_as_horovodrun_would_give_it():
    plan = {allreduce_slurm.SLOTS_VARIABLE: "gpu01:2,gpu02:1"}
    assert allreduce_slurm.gloo_rank_env({}) == {}
    third = allreduce_slurm.gloo_rank_env({**plan, "SLURMD_NODENAME": "gpu02", "SLURM_LOCALID": "0"})
    assert third == {"HOROVOD_HOSTNAME": "gpu02", "HOROVOD_RANK": "2", "HOROVOD_SIZE": "3", "HOROVOD_LOCAL_RANK": "0",
                     "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}
    second = allreduce_slurm.gloo_rank_env({**plan, "SLURMD_NODENAME": "gpu01", "SLURM_LOCALID": "1"})
    assert (second["HOROVOD_RANK"], second["HOROVOD_CROSS_RANK"], second["HOROVOD_CROSS_SIZE"]) == ("1", "0", "1")
    with pytest.raises(SystemExit, match="srun placed task 1 of node gpu02 outside the doctor's plan"):
        allreduce_slurm.gloo_rank_env({**plan, "SLURMD_NODENAME": "gpu02", "SLURM_LOCALID": "1"})


FAKE_SRUN = """#!/bin/sh
echo "$@" >> "{calls}"
echo "srun: Job 4242 step creation temporarily disabled, retrying (Requested nodes are busy)" >&2
echo "srun: error: Unable to create step for job 4242: More processors requested than permitted" >&2
exit 1
"""


def test_a_step_srun_cannot_start_is_one_line_with_the_fix_and_ends_the_measurements(tmp_path, monkeypatch, capsys):
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN.format(calls=calls))
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    host = Host("localhost", 3)
    host.address = "127.0.0.1"
    results, failed = doctor.measure(["gloo", "mpi"], [host], slurm_args(), [4096], False, None, None, [])
    assert results == [] and len(calls.read_text().splitlines()) == 1  # gloo's step only: mpi's would fail alike
    assert failed == [
        "srun could not start the 3 allreduce ranks in Slurm job 4242 (srun: error: Unable to create step for job "
        "4242: More processors requested than permitted): the measurement runs one task per slot (localhost:3) "
        "with a CPU each, inside the allocation; ask for them (sbatch/salloc --ntasks=3 --nodes=1), or add "
        "--skip-bench (the host checks above stand)"]
    out = capsys.readouterr().out
    assert "measuring allreduce with the gloo controller (an srun step of Slurm job 4242) ..." in out
    assert allreduce_slurm.not_started("mpi", [host], "srun: error: Couldn't find the specified plugin name for "
                                       "mpi/pmix looking at all files\n").startswith(
        "mpi controller: srun could not start the ranks with --mpi=")
