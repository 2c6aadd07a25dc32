"""``hvdtrain doctor`` against the two ssh-reachable machines and a host that does not answer."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from .nodes import BIN, TwoNodes


def doctor(nodes: TwoNodes, tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "doctor", *args], cwd=tmp_path,
                          env=nodes.env(tmp_path), capture_output=True, text=True, timeout=600)


def test_doctor_checks_both_nodes_and_measures_allreduce(two_nodes, tmp_path):
    hostfile = two_nodes.hostfile(tmp_path / "hosts")
    before = two_nodes.accepted_logins()
    # No --network-interfaces: the doctor picks lo, the interface whose subnet holds both nodes'
    # addresses. Left to horovodrun, Open MPI gets lo and eth0 and can hang (docs/launching.md, "Pin one
    # interface").
    result = doctor(two_nodes, tmp_path, "--hostfile", str(hostfile), "--sizes", "4K,256K,4M")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert re.search(r"^to pin the network: horovodrun --network-interfaces lo \.\.\. and NCCL_SOCKET_IFNAME=lo ",
                     out, re.M), out
    assert "(the measurements use --network-interfaces lo)" in out
    for host in two_nodes.hosts:  # one row per host: versions and Horovod's build
        row = rf"^{host}\s+1\s+3\.\d+\.\d+\s+\S+\s+0\.28\.1\s+0\.1\.0\s+\S*gloo\+mpi\s+none$"
        assert re.search(row, out, re.M), out
    assert re.search(r"network interfaces on every host: .*\blo\b", out)
    header = next(line for line in out.splitlines() if line.strip().startswith("size"))
    assert header.split() == ["size", "gloo/cpu", "mpi/cpu"]
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+ (KiB|MiB)\s", line)]
    assert [" ".join(row[:2]) for row in rows] == ["4 KiB", "256 KiB", "4 MiB"]
    assert all(float(value) > 0 for row in rows for value in row[2:])
    assert re.search(r"^fastest at 4 MiB: (gloo|mpi)/cpu \(\d+\.\d+ [MG]B/s\)$", out, re.M), out
    assert "over 2 ranks" in out
    logins = {h: n - before[h] for h, n in two_nodes.accepted_logins().items()}
    # The probe, then each controller's job, reached both machines over ssh.
    assert logins["node0"] >= 3 and logins["node1"] >= 3, logins


def test_doctor_names_the_unreachable_host_and_fails(two_nodes, tmp_path):
    result = doctor(two_nodes, tmp_path, "-H", f"node0:1,{two_nodes.unreachable_host}:1", "--skip-bench")
    assert result.returncode == 1
    assert re.search(r"^hvdtrain doctor: node-down: not reachable over ssh \(.*Connection refused\)",
                     result.stderr, re.M), result.stderr
    assert "node0:" not in result.stderr  # the reachable host is not blamed
    assert re.search(r"^node0\s+1\s+3\.", result.stdout, re.M)
    assert "measuring allreduce" not in result.stdout


def bench_processes(cwd: Path) -> list[int]:
    """Launchers and ranks of the doctor's bench still running in ``cwd`` (both nodes are this box)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"--bench" in (entry / "cmdline").read_bytes() \
                    and Path(entry / "cwd").resolve() == cwd.resolve():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
def test_doctor_ends_a_launch_at_its_deadline_and_says_how_far_it_got(two_nodes, tmp_path):
    # 100000 allreduces per size cannot finish in 20 s: both jobs are ended at their deadline (20 s
    # leaves the ranks time to start on both hosts, which the message says).
    start = time.monotonic()
    result = doctor(two_nodes, tmp_path, "-H", "node0:1,node1:1", "--sizes", "4K", "--iters", "100000",
                    "--bench-timeout", "20")
    took = time.monotonic() - start
    assert result.returncode == 1, result.stdout + result.stderr
    for controller, other in (("gloo", "mpi"), ("mpi", "gloo")):
        assert re.search(rf"^hvdtrain doctor: {controller} controller: no result within 20s: ranks started on "
                         rf"node0, node1 but no allreduce finished; try .*, or --controllers {other}$",
                         result.stderr, re.M), result.stderr
    assert took < 2 * (20 + 15) + 60, took  # two deadlines, their grace, the probe
    # Nothing is left: not the launchers, not the ranks that ssh started (they end themselves once
    # their ssh session is gone, within a second or two).
    deadline = time.monotonic() + 15
    while bench_processes(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert bench_processes(tmp_path) == []


def test_doctor_inside_a_slurm_allocation_probes_its_nodes_with_srun(slurm_cluster, tmp_path):
    """`srun -n2 python -m hvdtrain doctor` in a batch job: no -H, the allocation's node (with its 2
    tasks as slots), probed by a step of the job itself; the second task leaves at once."""
    script = tmp_path / "doctor.sbatch"
    script.write_text(f"#!/bin/sh\nexec srun --nodes=1 --ntasks=2 {BIN / 'python'} -m hvdtrain doctor --skip-bench\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    job, state, out = slurm_cluster.sbatch(script, [], tmp_path, env, ["--ntasks=2", "--nodes=1"], timeout=400)
    assert state == "COMPLETED", out
    assert f"hvdtrain doctor: in Slurm job {job}: its 1 node(s), probed with srun" in out, out
    assert out.count("hvdtrain doctor: 1 host(s), 2 slot(s)") == 1, out  # one doctor for the step's two tasks
    assert re.search(rf"^{slurm_cluster.node}\s+2\s+3\.\d+\.\d+\s", out, re.M), out
    assert "hosts OK (bandwidth not measured: --skip-bench)" in out, out


def test_doctor_inside_a_slurm_allocation_measures_allreduce_as_srun_steps_without_ssh(slurm_cluster, tmp_path):
    """The same doctor without --skip-bench: each controller's allreduce ranks are a step of the job
    (srun --mpi=pmix for MPI; for Gloo srun --mpi=none and the doctor's own rendezvous), not horovodrun.
    ssh on PATH is a stand-in that records any call and fails, as on a cluster that closes it."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'ssh-calls'}\nexit 255\n")
    (fake / "ssh").chmod(0o755)
    script = tmp_path / "doctor.sbatch"
    script.write_text(f"#!/bin/sh\nexec srun --nodes=1 --ntasks=2 {BIN / 'python'} -m hvdtrain doctor "
                      "--sizes 4K,256K --warmup 1 --iters 3 --bench-timeout 60\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"PATH": f"{fake}:{env['PATH']}", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "OMPI_MCA_btl_vader_single_copy_mechanism": "none"})
    job, state, out = slurm_cluster.sbatch(script, [], tmp_path, env, ["--ntasks=2", "--nodes=1"], timeout=300)
    assert state == "COMPLETED", out
    assert f"hvdtrain doctor: in Slurm job {job}: its 1 node(s), probed with srun" in out, out
    for controller in ("gloo", "mpi"):
        assert f"measuring allreduce with the {controller} controller (an srun step of Slurm job {job}) ..." in out, out
    header = next(line for line in out.splitlines() if line.strip().startswith("size"))
    assert header.split() == ["size", "gloo/cpu", "mpi/cpu"], out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+ (KiB|MiB)\s", line)]
    assert [" ".join(row[:2]) for row in rows] == ["4 KiB", "256 KiB"], out
    assert all(float(value) > 0 for row in rows for value in row[2:]), out
    assert "over 2 ranks" in out
    assert (f"\nallreduce ranks launched with srun in Slurm job {job}, 2 ranks on 1 node(s) (gloo: srun --mpi=none "
            "and the doctor's rendezvous, mpi: srun --mpi=pmix); no ssh\n") in out, out
    assert not (tmp_path / "ssh-calls").exists(), (tmp_path / "ssh-calls").read_text()


def test_doctor_inside_an_allocation_whose_step_cannot_start_says_so_in_one_line(slurm_cluster, tmp_path):
    """The doctor in the batch script itself, told of 3 tasks where the job has 2 CPUs: srun cannot
    create the measurement's step. One line with the fix, after the full host report, exit 1, and
    the second controller is not tried."""
    script = tmp_path / "doctor.sbatch"
    script.write_text(f"#!/bin/sh\nSLURM_TASKS_PER_NODE=3 exec {BIN / 'python'} -m hvdtrain doctor --sizes 4K "
                      "--bench-timeout 60\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    job, state, out = slurm_cluster.sbatch(script, [], tmp_path, env, ["--ntasks=2", "--nodes=1"], timeout=300)
    assert state == "FAILED", out
    node = slurm_cluster.node
    assert re.search(rf"^{node}\s+3\s+3\.\d+\.\d+\s", out, re.M), out  # the host report stands
    assert out.count("measuring allreduce with the") == 1, out
    assert re.search(rf"^hvdtrain doctor: srun could not start the 3 allreduce ranks in Slurm job {job} \(srun: error: "
                     rf"Unable to create step for job {job}: .*\): the measurement runs one task per slot \({node}:3\) "
                     r"with a CPU each, inside the allocation; ask for them \(sbatch/salloc --ntasks=3 --nodes=1\), or "
                     r"add --skip-bench \(the host checks above stand\)$", out, re.M), out
    assert "allreduce ranks launched" not in out
