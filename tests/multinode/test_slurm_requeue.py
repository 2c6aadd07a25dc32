"""Slurm stops, requeues and records: the shipped batch scripts on a one-machine Slurm cluster.

A stop during epoch 1 of 3 does what its sender meant. train.sbatch is cancelled by a plain `scancel
JOB`: the ranks checkpoint, the job ends CANCELLED and is not requeued, and its log gives the
command that continues the run, which, submitted, resumes it in the same folder and finishes
(job.json names the job it continued); another job on that folder, not asked to continue it, stops
in one line. train-horovodrun.sbatch is stopped by the time-limit signal (`scancel --batch
--signal=USR1` twice within 100 ms, which reaches the batch shell alone, as `#SBATCH
--signal=B:USR1@120` does ahead of the limit) and by `scontrol requeue` from outside (which
signals the batch shell and the waiting step and requeues the job itself): the ranks checkpoint
and exit 75, the job is requeued (the script says so only when Slurm has it), and it then
finishes: COMPLETED with Restarts >= 1, its log holding both attempts and no scheduler error,
attempts.jsonl both starts and ends, every epoch's train record the whole epoch, every metrics
record its job and attempt. A SIGTERM that asks for no requeue (`scancel --batch --signal=TERM`)
ends the job FAILED 75:0, and a job waiting on it with afterok never runs. train.sbatch is also
stopped twice in its first seconds (a clean 75, a requeue), and once more after the requeue: two
attempts without a step end the job with the line that says so. A bad data.dir, or a package a
file of the user's hides, ends the job with hvdtrain's own exit code 2, which is what Slurm
records. (The other decisions, a preemption, the time limit itself, a slurmctld that does not
answer: the script's unit tests, tests/unit/test_slurm_requeue_script.py.)
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


def submit(cluster, script: str, args: list[str], tmp_path: Path, options: list[str] = (),
           env: dict[str, str] | None = None) -> str:
    result = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path / 'slurm-%j.out'}", *ONE_NODE, *options,
                             str(SLURM / script), *args], cwd=tmp_path,
                            env={**job_env(tmp_path), **(env or {}), **cluster.env()},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0]


def job_fields(cluster, job: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", job], env=cluster.env(), capture_output=True, text=True).stdout
    return dict(re.findall(r"(JobState|Restarts|ExitCode)=(\S+)", shown))


def wait_until(predicate, what: str, timeout: float, cluster, job: str, log: Path | None = None) -> None:
    """Wait for an event; on the deadline, cancel the job and show Slurm's word, the job's ``log``
    and the daemons' logs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    subprocess.run(["scancel", job], env=cluster.env())
    text = log.read_text() if log is not None and log.exists() else "(no log)"
    raise AssertionError(f"job {job}: timed out waiting for {what}: {job_fields(cluster, job)}\n"
                         f"--- the job's log\n{text}\n{cluster.logs()}")


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


def stop_job(cluster, job: str, how: str) -> None:
    """``how``: ``cancel`` (a plain scancel), ``batch-twice`` (scancel --batch --signal=USR1 twice
    within 100 ms, as the time-limit signal and a stop by hand may come together), ``requeue``
    (scontrol requeue from outside: Slurm signals the batch shell and the steps, and requeues the job
    itself)."""
    env = cluster.env()
    if how == "cancel":
        subprocess.run(["scancel", job], env=env, check=True)
    elif how == "batch-twice":
        first = subprocess.Popen(["scancel", "--batch", "--signal=USR1", job], env=env)
        second = subprocess.Popen(["scancel", "--batch", "--signal=USR1", job], env=env)
        assert first.wait(timeout=60) == 0 and second.wait(timeout=60) == 0
    else:
        subprocess.run(["scontrol", "requeue", job], env=env, check=True)


def assert_quiet(text: str, finished: bool = True) -> None:
    """No mpirun abort block, no traceback and no closing line without its checkpoint anywhere, and,
    where the job ``finished``, no scheduler error after its last attempt started (a stopped
    attempt has Slurm's own lines: CANCELLED, and under horovodrun mpirun's)."""
    for noise in ("Per user-direction", "saved to None", "Traceback", "partially initialized", "No such process"):
        assert noise not in text, f"{noise!r} in the job's log:\n{text}"
    last = text[text.rfind("(restart "):]
    if finished:
        for noise in ("slurmstepd: error", "srun: error"):
            assert noise not in last, f"{noise!r} after the last attempt's start:\n{text}"


def check_train_records(run_dir: Path, job: str, attempt: int) -> list[dict]:
    """Epochs 0-2 trained once each, in whole; every metrics record of the attempt that finished."""
    metrics = records(run_dir / "metrics.jsonl")
    val = [r for r in metrics if r["split"] == "val"]
    assert val[-1]["epoch"] == 2, val
    train = {r["epoch"]: r for r in metrics if r["split"] == "train"}
    assert sorted(train) == [0, 1, 2] and all(r["samples"] == 96 for r in train.values()), train
    # Every record names its job and the attempt that wrote it: the one that finished epoch 1.
    assert {(r["job"], r["attempt"]) for r in metrics} == {(job, attempt)}, metrics
    return metrics


@pytest.mark.parametrize("how", ["batch-twice", "requeue"],
                         ids=["horovodrun-time-limit-signal-twice-to-the-batch-shell", "horovodrun-scontrol-requeue"])
@pytest.mark.slow
def test_a_stopped_job_checkpoints_requeues_itself_and_finishes(how, slurm_cluster, tiny_data, tmp_path):
    script = "train-horovodrun.sbatch"
    run_dir = tmp_path / "run"
    job = submit(slurm_cluster, script, TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}"], tmp_path)
    log = tmp_path / f"slurm-{job}.out"
    wait_until(lambda: (run_dir / "checkpoints" / "step-00000002.pt").exists(), "epoch 1's step 2", 300,
               slurm_cluster, job, log)
    sent = time.monotonic()
    stop_job(slurm_cluster, job, how)
    # The first attempt's closing line (requeue.sh's word on the requeue, whatever it is), then what it says.
    closing = f"hvdtrain: job {job} stopped after a checkpoint (exit 75)"
    wait_until(lambda: closing in log.read_text(), "the stopped attempt's closing line", 90, slurm_cluster, job, log)
    stopped = time.monotonic() - sent
    said = ("requeued already by Slurm (restart 1)" if how == "requeue"
            else "at the time-limit signal (SIGUSR1): requeued (restart 1 of at most 20)")
    assert said in log.read_text(), log.read_text()
    assert stopped < 90, f"took {stopped:.0f} s to stop"
    # Nothing of the stopped attempt runs on: no rank, no launcher (their argv names the data folder).
    assert training_processes(str(tiny_data)) == {}, "a process of the stopped attempt is still running"
    fields = wait_for_end(slurm_cluster, job)
    text = log.read_text()
    assert fields["JobState"] == "COMPLETED" and int(fields["Restarts"]) >= 1, f"{fields}\n{text}"
    # One log for both attempts (--open-mode=append): the stop line, the requeue, the resume.
    assert "stopped by SIG" in text and "A requeue of this job resumes it" in text, text
    assert "(restart 0)" in text and "(restart 1)" in text and "resumed from" in text, text
    # The batch shell says a stop once (a second signal is absorbed).
    assert text.count("stop signal (SIG") == 1, text
    assert "could not be requeued" not in text and "to continue the run" not in text, text
    assert_quiet(text)
    # The launcher's closing line: rank 0's, with the checkpoint it wrote.
    assert "rank 0: stopped by SIG" in text and f"checkpoint saved to {run_dir}/checkpoints/" in text, text
    check_train_records(run_dir, job, 1)
    attempts = records(run_dir / "attempts.jsonl")
    assert [(a["event"], a["job"], a["restart"]) for a in attempts] == [
        ("start", job, 0), ("end", job, 0), ("start", job, 1), ("end", job, 1)], attempts
    assert [a.get("attempt") for a in attempts if a["event"] == "start"] == [0, 1]
    assert attempts[0]["hosts"] == [slurm_cluster.node] and attempts[0]["ranks"] == 2
    assert attempts[1]["exit"] == 75 and attempts[1]["reason"].startswith("stopped by SIG"), attempts[1]
    assert (attempts[2]["epoch"], attempts[2]["step"]) == (attempts[1]["epoch"], attempts[1]["step"]) != (0, 0)
    assert attempts[3]["exit"] == 0 and attempts[3]["reason"] == "finished" and attempts[3]["epoch"] == 3
    owner = json.loads((run_dir / "job.json").read_text())
    assert (owner["scheduler"], owner["job"], owner["restart"]) == ("Slurm", job, 1), owner


@pytest.mark.slow
def test_a_cancelled_job_keeps_its_checkpoint_and_the_advised_command_continues_it(slurm_cluster, tiny_data,
                                                                                  tmp_path):
    """srun's job writes the folder a job gets by default (the config names none):
    runs/<job name>-<job id>. A plain `scancel` cancels it: not requeued (Slurm would accept a
    requeue of the job being cancelled, and it would come back PENDING)."""
    job = submit(slurm_cluster, "train.sbatch", TRAIN + [f"data.dir={tiny_data}"], tmp_path)
    run_dir = tmp_path / "runs" / f"hvdtrain-{job}"  # #SBATCH --job-name=hvdtrain
    log = tmp_path / f"slurm-{job}.out"
    wait_until(lambda: (run_dir / "checkpoints" / "step-00000002.pt").exists(), "epoch 1's step 2", 300,
               slurm_cluster, job, log)
    stop_job(slurm_cluster, job, "cancel")
    closing = f"hvdtrain: job {job} cancelled (scancel) after a checkpoint: not requeued, the checkpoint is kept; "
    wait_until(lambda: closing in log.read_text(), "the cancelled attempt's closing line", 90, slurm_cluster, job, log)
    fields = wait_for_end(slurm_cluster, job)
    text = log.read_text()
    assert (fields["JobState"], fields["Restarts"]) == ("CANCELLED", "0"), f"{fields}\n{text}"
    assert "requeued" not in text.replace("not requeued", ""), text
    assert "Exited with exit code 75" not in text, text  # srun's line: the script's own says more
    assert training_processes(str(tiny_data)) == {}, "a process of the cancelled attempt is still running"
    advice = re.search(r"to continue the run: sbatch \[the same options\] (\S+) (.*)$",
                       text[text.index(closing):].splitlines()[0])
    assert advice and advice[1] == str(SLURM / "train.sbatch"), text
    args = advice[2].split(" ")  # no spaces in these paths: printf %q left them as they are
    assert args[-2:] == [f"output.dir={run_dir}", f"checkpoint.resume={run_dir}/checkpoints/last.pt"], args
    stopped = records(run_dir / "attempts.jsonl")[-1]
    assert (stopped["event"], stopped["exit"]) == ("end", 75) and stopped["step"] > 0, stopped
    # The advised command, submitted: it continues the run in its folder, to the end.
    second = submit(slurm_cluster, "train.sbatch", args, tmp_path)
    fields = wait_for_end(slurm_cluster, second)
    text = (tmp_path / f"slurm-{second}.out").read_text()
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "0"), f"{fields}\n{text}"
    assert "resumed from" in text and f"{run_dir}/checkpoints/last.pt" in text, text
    assert_quiet(text)
    metrics = check_train_records(run_dir, second, 1)
    attempts = records(run_dir / "attempts.jsonl")
    assert [(a["event"], a["job"], a["restart"]) for a in attempts] == [
        ("start", job, 0), ("end", job, 0), ("start", second, 0), ("end", second, 0)], attempts
    assert [a.get("attempt") for a in attempts if a["event"] == "start"] == [0, 1]
    assert attempts[3]["exit"] == 0 and attempts[3]["reason"] == "finished" and attempts[3]["epoch"] == 3
    assert (attempts[2]["epoch"], attempts[2]["step"]) == (attempts[1]["epoch"], attempts[1]["step"]), attempts
    owner = json.loads((run_dir / "job.json").read_text())
    assert (owner["job"], owner["continues"]["job"]) == (second, job), owner
    # Another job on that finished run: it does not continue it without being asked.
    third = submit(slurm_cluster, "train.sbatch", TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}",
                                                           "train.epochs=4"], tmp_path)
    fields = wait_for_end(slurm_cluster, third, timeout=300)
    text = (tmp_path / f"slurm-{third}.out").read_text()
    state = (fields["JobState"], fields["ExitCode"], fields["Restarts"])
    assert state == ("FAILED", "2:0", "0"), f"{fields}\n{text}"
    assert f"holds the run of Slurm job {second} (" in text and f"not of this job (Slurm job {third})" in text, text
    assert len(records(run_dir / "metrics.jsonl")) == len(metrics)  # nothing written


@pytest.mark.slow
def test_a_stop_that_asks_for_no_requeue_ends_failed_75_and_holds_back_afterok(slurm_cluster, tiny_data, tmp_path):
    """`scancel --batch --signal=TERM` (a SIGTERM Slurm does not explain: no cancel, preemption or
    time limit): the ranks checkpoint, the job is not requeued and ends FAILED 75:0, on purpose: a
    job that waits on it with --dependency=afterok never starts on the unfinished run. srun's own
    line on the 75 stays out of the log."""
    run_dir = tmp_path / "run"
    job = submit(slurm_cluster, "train.sbatch", TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}"], tmp_path)
    log = tmp_path / f"slurm-{job}.out"
    after = subprocess.run(["sbatch", "--parsable", f"--dependency=afterok:{job}", f"--output={tmp_path / 'after.out'}",
                            "--nodes=1", "--ntasks=1", "--cpus-per-task=1", "--time=1", "--wrap=true"],
                           cwd=tmp_path, env={**os.environ, **slurm_cluster.env()}, capture_output=True, text=True,
                           timeout=60)
    assert after.returncode == 0, after.stderr
    waiting = after.stdout.strip().split(";")[0]
    try:
        wait_until(lambda: (run_dir / "checkpoints" / "step-00000002.pt").exists(), "epoch 1's step 2", 300,
                   slurm_cluster, job, log)
        subprocess.run(["scancel", "--batch", "--signal=TERM", job], env=slurm_cluster.env(), check=True)
        fields = wait_for_end(slurm_cluster, job)
        text = log.read_text()
        state = (fields["JobState"], fields["ExitCode"], fields["Restarts"])
        assert state == ("FAILED", "75:0", "0"), f"{fields}\n{text}"
        assert (f"hvdtrain: job {job} stopped after a checkpoint (exit 75) by SIGTERM, which asks for no requeue"
                in text), text
        assert f"output.dir={run_dir} checkpoint.resume={run_dir}/checkpoints/last.pt" in text, text
        assert "Exited with exit code 75" not in text, text
        stopped = records(run_dir / "attempts.jsonl")[-1]
        assert (stopped["event"], stopped["exit"]) == ("end", 75) and stopped["step"] > 0, stopped

        def held() -> bool:
            shown = subprocess.run(["scontrol", "show", "job", waiting], env=slurm_cluster.env(), capture_output=True,
                                   text=True).stdout
            return "Reason=DependencyNeverSatisfied" in shown or "JobState=CANCELLED" in shown

        wait_until(held, "the afterok job's DependencyNeverSatisfied", 120, slurm_cluster, waiting)
        assert not (tmp_path / "after.out").exists()  # it never ran
    finally:
        subprocess.run(["scancel", waiting], env=slurm_cluster.env())


def test_a_stop_in_the_first_seconds_requeues_and_a_job_that_cannot_progress_is_named(slurm_cluster, tiny_data,
                                                                                      tmp_path):
    """Two stop signals within 100 ms while srun starts the ranks: a clean 75 and a requeue, not a
    crash (srun's job used to end FAILED 138: a rank still importing ended on SIGUSR1; the
    horovodrun script's launcher is tested so in tests/parallel/test_launch.py). The requeued
    attempt is stopped the same way: two attempts in a row without a step, and the job ends (exit 2)
    with the line that says so, instead of requeuing to HVDTRAIN_MAX_REQUEUES."""
    run_dir = tmp_path / "run"
    job = submit(slurm_cluster, "train.sbatch", ["--config", "debug", f"data.dir={tiny_data}", f"output.dir={run_dir}",
                                                 "output.progress=false"], tmp_path)
    log = tmp_path / f"slurm-{job}.out"
    for restart in (0, 1):
        # The attempt's ranks exist (an interpreter whose argv names the data; srun's is not one):
        # the batch shell has started srun, and the stop reaches ranks that are starting.
        wait_until(lambda: log.exists() and f"(restart {restart})" in log.read_text()
                   and training_processes(str(tiny_data)) != {}, f"attempt {restart}'s ranks", 300,
                   slurm_cluster, job, log)
        stop_job(slurm_cluster, job, "batch-twice")
    fields = wait_for_end(slurm_cluster, job, timeout=400)
    text = log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "1"), f"{fields}\n{text}"
    assert_quiet(text, finished=False)
    attempts = records(run_dir / "attempts.jsonl")
    ends = [a for a in attempts if a["event"] == "end"]
    assert [(a["exit"], a["step"]) for a in ends] == [(75, 0), (2, 0)], attempts
    assert "requeued (restart 1 of at most 20)" in text, text
    assert "attempts stopped twice at global step 0 without training a step: start-up takes about " in text, text
    assert "not requeued (exit 2): give each attempt at least " in text, text
    assert (run_dir / "checkpoints" / "last.pt").exists()  # nothing lost: the position of step 0


@pytest.mark.parametrize("script", ["train.sbatch", "train-horovodrun.sbatch"])
def test_bad_input_is_recorded_with_hvdtrains_own_exit_code(script, slurm_cluster, tmp_path):
    """A missing data folder (srun), a package hidden by a file of the user's on PYTHONPATH
    (horovodrun): one line, Slurm's exit code 2."""
    env = {}
    if script == "train.sbatch":
        args, said = ["--config", "debug", f"data.dir={tmp_path / 'missing'}"], "missing"
    else:
        (tmp_path / "mine").mkdir()
        (tmp_path / "mine" / "tqdm.py").write_text("")  # hides the installed tqdm (the job's own folder is
        env = {"PYTHONPATH": f"{tmp_path / 'mine'}:{REPO}"}  # never on the path: python -P)
        args = ["--config", "debug", "data.synthetic=true"]
        said = f"module 'tqdm' is shadowed by {tmp_path / 'mine' / 'tqdm.py'}"
    job = submit(slurm_cluster, script, args + [f"output.dir={tmp_path / 'run'}"], tmp_path, env=env)
    fields = wait_for_end(slurm_cluster, job, timeout=300)
    text = (tmp_path / f"slurm-{job}.out").read_text()
    # Not 143 (the other rank killed by srun --kill-on-bad-exit), not horovodrun's 1; never requeued.
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "2:0", "0"), f"{fields}\n{text}"
    assert said in text and "Traceback" not in text, text
    assert_quiet(text, finished=False)
