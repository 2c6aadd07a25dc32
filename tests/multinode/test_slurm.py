"""The shipped Slurm batch scripts, submitted with sbatch to a real (one-machine) Slurm cluster.

train.sbatch starts the ranks with ``srun --mpi=pmix`` (Horovod's MPI controller gets rank, size
and local rank from PMIx); train-horovodrun.sbatch builds a horovodrun host list from the
allocation. Both must train 2 ranks to identical parameters.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import torch

from .nodes import BIN, REPO

PROBE = REPO / "tests" / "parallel" / "probe.py"
SLURM = REPO / "hostfiles" / "slurm"
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=10"]


def job_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "HVDTRAIN_DIR": str(REPO), "PYTHON": str(BIN / "python"), "PYTHONPATH": str(REPO),
        "HVDTRAIN_ENTRY": f"{PROBE} {tmp_path / 'probe'}", "HVDTRAIN_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
    })
    return env


def train_args(tiny_data: Path, tmp_path: Path) -> list[str]:
    return ["--config", "debug", f"data.dir={tiny_data}", f"output.dir={tmp_path / 'run'}",
            "train.epochs=1", "train.steps_per_epoch=3"]


def load_ranks(tmp_path: Path) -> list[dict]:
    ranks = [torch.load(tmp_path / "probe" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for key, value in ranks[1]["state"].items():
        assert torch.equal(ranks[0]["state"][key], value), f"{key} differs between ranks"
    assert ranks[0]["step"] == ranks[1]["step"] == 3
    return ranks


def test_sbatch_srun_pmix_gives_each_rank_its_rank_size_and_local_rank(slurm_cluster, tiny_data, tmp_path):
    """The user's own copy of the script (``hvdtrain slurm-script > my.sbatch``, kept in their folder,
    no PYTHON or HVDTRAIN_DIR set) finds the install; the ranks take their threads from
    --cpus-per-task."""
    written = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "slurm-script"], capture_output=True, text=True,
                             env=job_env(tmp_path), timeout=120)
    assert written.returncode == 0, written.stderr
    mine = tmp_path / "my.sbatch"
    mine.write_text(written.stdout)
    env = {key: value for key, value in job_env(tmp_path).items() if key not in ("PYTHON", "HVDTRAIN_DIR")}
    job, state, output = slurm_cluster.sbatch(mine, train_args(tiny_data, tmp_path) + ["runtime.threads=0"], tmp_path,
                                              env, ONE_NODE)
    assert state == "COMPLETED", f"job {job} {state}\n{output}\n{slurm_cluster.logs()}"
    assert "1 threads/rank (SLURM_CPUS_PER_TASK=1)" in output, output
    ranks = load_ranks(tmp_path)
    assert [(r["rank"], r["size"], r["local_rank"], r["controller"]) for r in ranks] == [
        (0, 2, 0, "mpi"), (1, 2, 1, "mpi")]
    for r in ranks:
        env = r["launcher_env"]
        assert env["SLURM_PROCID"] == env["PMIX_RANK"] == str(r["rank"])
        assert env["SLURM_LOCALID"] == str(r["local_rank"]) and env["SLURM_NTASKS"] == "2"
    assert f"job {job}, 2 ranks on 1 node(s)" in output
    assert "2 ranks on 1 host(s) (mpi controller)" in output


def test_sbatch_horovodrun_builds_its_host_list_from_the_allocation(slurm_cluster, tiny_data, tmp_path):
    job, state, output = slurm_cluster.sbatch(SLURM / "train-horovodrun.sbatch", train_args(tiny_data, tmp_path),
                                              tmp_path, job_env(tmp_path), ONE_NODE)
    assert state == "COMPLETED", f"job {job} {state}\n{output}\n{slurm_cluster.logs()}"
    assert f"horovodrun -np 2 -H {slurm_cluster.node}:2" in output
    # The waiting step ends by itself: no "slurmstepd: error: *** STEP ... CANCELLED ***", no kill errors.
    assert "slurmstepd" not in output and "No such process" not in output, output
    ranks = load_ranks(tmp_path)
    assert [(r["rank"], r["size"], r["local_rank"], r["controller"]) for r in ranks] == [
        (0, 2, 0, "mpi"), (1, 2, 1, "mpi")]  # horovodrun prefers mpirun when Open MPI is there


def test_hostlist_expands_slurms_compressed_task_counts(tmp_path):
    # A stand-in scontrol: the real one is tested above; this covers several nodes and counts.
    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\nprintf 'gpu01\\ngpu02\\ngpu03\\n'\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[01-03]",
           "SLURM_TASKS_PER_NODE": "8(x2),4"}
    result = subprocess.run(["bash", str(SLURM / "hostlist.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "gpu01:8,gpu02:8,gpu03:4"
    env["SLURM_TASKS_PER_NODE"] = "8"
    result = subprocess.run(["bash", str(SLURM / "hostlist.sh")], env=env, capture_output=True, text=True)
    assert result.returncode == 1 and "3 nodes" in result.stderr
