"""Slurm stops, requeues and records: the shipped batch scripts on a one-machine Slurm cluster.

Each script is stopped with SIGTERM during epoch 1 of 3 (train.sbatch by `scancel --signal=TERM`,
which reaches the ranks' step; train-horovodrun.sbatch by `scancel --batch --signal=TERM`, which
reaches the batch shell alone, as `#SBATCH --signal=B:TERM@120` does ahead of the time limit, and
by `scancel --signal=TERM`, which reaches its waiting step). The ranks checkpoint and exit 75, the
script requeues the job, and the job then finishes: COMPLETED with Restarts >= 1, its log holding
both attempts, attempts.jsonl both starts and ends, every epoch's train record the whole epoch.
A bad data.dir ends the job with hvdtrain's own exit code 2, which is what Slurm records.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import training_processes

from .nodes import BIN, REPO

SLURM = REPO / "hostfiles" / "slurm"
ONE_NODE = ["--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--time=15"]
# 96 images at 4 per rank: 12 steps an epoch; a mid-epoch checkpoint at step 2 says epoch 1 is under way.
TRAIN = ["--config", "debug", "train.epochs=3", "train.steps_per_epoch=0", "train.batch_size=4",
         "checkpoint.every_steps=2", "checkpoint.keep=2", "output.progress=false"]


def job_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("HVDTRAIN_ENTRY", None)
    env.update({"HVDTRAIN_DIR": str(REPO), "PYTHON": str(BIN / "python"), "PYTHONPATH": str(REPO),
                "HVDTRAIN_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
                "OMPI_MCA_btl_vader_single_copy_mechanism": "none"})
    return env


def submit(cluster, script: str, args: list[str], tmp_path: Path) -> str:
    result = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'slurm-%j.out'}", *ONE_NODE,
                             str(SLURM / script), *args], cwd=tmp_path, env={**job_env(tmp_path), **cluster.env()},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job_fields(cluster, job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job], env=cluster.env(), capture_output=True, text=True).stdout
    return dict(re.findall(r"(JobState|Restarts|ExitCode)=(\S+)", shown))


def wait_until(predicate, what: str, timeout: float, cluster, job: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    subprocess.run(["scancel", job], env=cluster.env())
    raise AssertionError(f"job {job}: timed out waiting for {what}: {job_fields(cluster, job)}\n{cluster.logs()}")


def wait_for_end(cluster, job: str, timeout: float = 600) -> dict[str, str]:
    ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
    fields: dict[str, str] = {}

    def done() -> bool:
        fields.update(job_fields(cluster, job))
        return fields.get("JobState") in ended

    wait_until(done, "its end", timeout, cluster, job)
    return fields


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("script, scancel", [
    ("train.sbatch", ["--signal=TERM"]),
    ("train-horovodrun.sbatch", ["--batch", "--signal=TERM"]),
    ("train-horovodrun.sbatch", ["--signal=TERM"]),
], ids=["srun-term-to-the-job", "horovodrun-term-to-the-batch-shell", "horovodrun-term-to-the-job"])
def test_a_stopped_job_checkpoints_requeues_itself_and_finishes(script, scancel, slurm_cluster, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    job = submit(slurm_cluster, script, TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}"], tmp_path)
    wait_until(lambda: (run_dir / "checkpoints" / "step-00000002.pt").exists(), "epoch 1's step 2", 300,
               slurm_cluster, job)
    sent = time.monotonic()
    subprocess.run(["scancel", *scancel, job], env=slurm_cluster.env(), check=True)
    log = tmp_path / f"slurm-{job}.out"
    wait_until(lambda: "requeued (restart 1" in log.read_text(), "the requeue", 60, slurm_cluster, job)
    stopped = time.monotonic() - sent
    assert stopped < 60, f"took {stopped:.0f} s to stop"
    # Nothing of the stopped attempt runs on: no rank, no launcher (their argv names the run folder).
    assert training_processes(str(run_dir)) == {}, "a process of the stopped attempt is still running"
    fields = wait_for_end(slurm_cluster, job)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, f"{fields}\n{text}"
    # One log for both attempts (--open-mode=append): the stop line, the requeue, the resume.
    assert "stopped by SIG" in text and "Resume with the same command" in text, text
    assert "(restart 0)" in text and "(restart 1)" in text and "resumed from" in text, text
    metrics = records(run_dir / "metrics.jsonl")
    val = [r for r in metrics if r["split"] == "val"]
    assert val[-1]["epoch"] == 2, val
    train = {r["epoch"]: r for r in metrics if r["split"] == "train"}
    assert sorted(train) == [0, 1, 2] and all(r["samples"] == 96 for r in train.values()), train
    attempts = records(run_dir / "attempts.jsonl")
    assert [(a["event"], a["job"], a["restart"]) for a in attempts] == [
        ("start", job, 0), ("end", job, 0), ("start", job, 1), ("end", job, 1)], attempts
    assert attempts[0]["hosts"] == [slurm_cluster.node] and attempts[0]["ranks"] == 2
    assert attempts[1]["exit"] == 75 and attempts[1]["reason"].startswith("stopped by SIG"), attempts[1]
    assert (attempts[2]["epoch"], attempts[2]["step"]) == (attempts[1]["epoch"], attempts[1]["step"]) != (0, 0)
    assert attempts[3]["exit"] == 0 and attempts[3]["reason"] == "finished" and attempts[3]["epoch"] == 3


@pytest.mark.parametrize("script", ["train.sbatch", "train-horovodrun.sbatch"])
def test_bad_input_is_recorded_with_hvdtrains_own_exit_code(script, slurm_cluster, tmp_path):
    job = submit(slurm_cluster, script, ["--config", "debug", f"data.dir={tmp_path / 'missing'}",
                                         f"output.dir={tmp_path / 'run'}"], tmp_path)
    fields = wait_for_end(slurm_cluster, job, timeout=300)
    text = (tmp_path / f"slurm-{job}.out").read_text()
    # Not 143 (the other rank killed by srun --kill-on-bad-exit), not horovodrun's 1; never requeued.
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0"), f"{fields}\n{text}"
    assert "missing" in text and "Traceback" not in text, text
