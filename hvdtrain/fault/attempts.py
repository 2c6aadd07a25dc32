"""attempts.jsonl in the run folder: one line when a job starts training on it, one when it leaves.

A run that a scheduler stops and requeues (Slurm: hostfiles/slurm/*.sbatch) is trained by several
jobs, or by one job id several times; the log of each attempt may be on another host. Rank 0
appends, at the start (after resume, so the position is known):

    {"event": "start", "time": "2026-11-27T04:05:01+00:00", "job": "1234", "restart": 1,
     "hosts": ["gpu01", "gpu02"], "ranks": 16, "epoch": 2, "step": 5421}

and at the end, with the exit code the job leaves with and its one-line reason:

    {"event": "end", "time": ..., "job": "1234", "restart": 1, "exit": 75,
     "reason": "stopped by SIGTERM in epoch 2/90 at step 417/5004 ...", "epoch": 2, "step": 5838}

``job`` and ``restart`` come from Slurm (SLURM_JOB_ID, SLURM_RESTART_COUNT: the times the job was
requeued), else from the other schedulers' job id variables (launch/job.py), else null; ``attempt``
counts the attempts on this run folder (0 for the first), as every metrics.jsonl record of the
attempt says too. A write that fails (a full disk) costs the line, with a warning, never the run.
"""

from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .. import outcome
from ..comm import dist
from ..launch.job import current as current_job
from ..ownership import PRIVATE, open_append

FILE = "attempts.jsonl"


def job_identity() -> dict[str, Any]:
    """The scheduler's job id and how many times it was requeued (null outside a scheduler)."""
    job = current_job()
    return {"job": job.id, "restart": job.restart}


def exit_of(error: BaseException | None) -> tuple[int, str]:
    """The exit code and one-line reason of a training loop that ended with ``error`` (None: finished)."""
    if error is None:
        return outcome.EXIT_OK, "finished"
    line = str(error).splitlines()[0] if str(error) else type(error).__name__
    if isinstance(error, KeyboardInterrupt):
        return outcome.EXIT_INTERRUPTED, "interrupted"
    if isinstance(error, outcome.user_errors()):
        return int(getattr(error, "exit_code", outcome.EXIT_BAD_INPUT)), line.removeprefix("hvdtrain: ")
    code = getattr(error, "exit_code", None)
    if isinstance(code, int):
        return code, line.removeprefix("hvdtrain: ")
    return outcome.EXIT_CRASH, f"{type(error).__name__}: {line}"


def append(run_dir: Path, record: dict[str, Any], share: str = PRIVATE) -> None:
    """One line at the end of ``run_dir/attempts.jsonl`` (the folder setup() made and checked), never
    through a planted link (ownership.open_append)."""
    try:
        with open_append(run_dir / FILE, share) as handle:
            handle.write(json.dumps(record) + "\n")
    except OSError as error:
        print(f"hvdtrain: warning: writing {FILE} in {run_dir} failed ({error.strerror or error}); "
              f"training goes on", file=sys.stderr, flush=True)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def record_start(run_dir: Path, hosts: list[str], ranks: int, epoch: int, step: int, share: str = PRIVATE,
                 attempt: int | None = None) -> None:
    """Rank 0: the line of this attempt's start (other ranks: nothing)."""
    if dist.is_primary():
        append(run_dir, {"event": "start", "time": now(), **job_identity(),
                         **({"attempt": attempt} if attempt is not None else {}),
                         "hosts": sorted(set(hosts)) or [socket.gethostname()], "ranks": ranks,
                         "epoch": epoch, "step": step}, share)


def record_end(run_dir: Path, error: BaseException | None, epoch: int, step: int, share: str = PRIVATE,
               timing: dict[str, float] | None = None) -> None:
    """Rank 0: the line of this attempt's end, ``error`` being what ended the loop (None: finished);
    ``timing``: its start-up and mean step seconds (what a time limit must leave room for)."""
    if dist.is_primary():
        code, reason = exit_of(error)
        append(run_dir, {"event": "end", "time": now(), **job_identity(), "exit": code, "reason": reason[:500],
                         "epoch": epoch, "step": step, **(timing or {})}, share)


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The records of attempts.jsonl (lines that do not parse are skipped)."""
    records = []
    try:
        with (run_dir / FILE).open(encoding="utf-8") as handle:
            for line in handle:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict):
                    records.append(record)
    except OSError:
        pass
    return records


# Where a stop came with less than this much of the job's time limit left, the limit sent it.
NEAR_THE_LIMIT_SECONDS = 5 * 60
# What --time should hold besides start-up and the signal's lead: some real training.
TRAINING_WANTED_SECONDS = 10 * 60


def no_progress_line(records: list[dict[str, Any]], step: int, startup_seconds: float,
                     time_limit: tuple[float, float] | None) -> str | None:
    """The line that ends requeuing, or None: this attempt stopped at global ``step`` without a
    step trained, as the attempt before it ended at the same step, and either that one trained
    nothing either (the line says "twice") or this stop came near the job's time limit (the line
    says how far the one before got) (``time_limit``: the limit and the
    job's run time at the stop, in seconds; None where unknown). Requeued again, the job would
    start, stop and requeue until HVDTRAIN_MAX_REQUEUES."""
    ends = [r for r in records if r.get("event") == "end"]
    starts = [r for r in records if r.get("event") == "start"]
    if not ends or ends[-1].get("step") != step or ends[-1].get("exit") != outcome.EXIT_PREEMPTED:
        return None
    previous_idle = bool(starts) and len(starts) >= 2 and starts[-2].get("step") == step
    near_limit = time_limit is not None and time_limit[0] - time_limit[1] <= NEAR_THE_LIMIT_SECONDS
    if not (previous_idle or near_limit):
        return None
    step_seconds = next((r["step_seconds"] for r in reversed(ends) if isinstance(r.get("step_seconds"), (int, float))),
                        None)
    startups = [r["startup_seconds"] for r in ends if isinstance(r.get("startup_seconds"), (int, float))]
    startup = max([startup_seconds, *startups])
    step_text = f"a step {step_seconds:.3g} s" if step_seconds else "a step more"
    training = max(TRAINING_WANTED_SECONDS, 100 * step_seconds) if step_seconds else TRAINING_WANTED_SECONDS
    if near_limit and time_limit is not None:
        limit, elapsed = time_limit
        lead = max(0.0, limit - elapsed)
        minutes = math.ceil((startup + lead + training) / 60)
        ask = (f"the stop signal came {elapsed:.0f} s into a time limit of {limit / 60:.0f} min; submit it "
               f"again with --time={minutes} or more (start-up, the signal's lead of about {lead:.0f} s and "
               f"{training / 60:.0f} min of steps)")
    else:
        ask = (f"give each attempt at least {math.ceil((startup + training) / 60)} min before its stop signal "
               f"(start-up and {training / 60:.0f} min of steps), or find what stops it this early")
    if previous_idle:
        what = f"attempts stopped twice at global step {step} without training a step"
    else:  # the attempt before trained: only this one, stopped by the limit, trained nothing
        trained = step - starts[-2]["step"] if len(starts) >= 2 and isinstance(starts[-2].get("step"), int) else None
        before = f"{trained} step{'' if trained == 1 else 's'}" if trained is not None else "to that step"
        what = (f"this attempt stopped at global step {step} without training a step (the one before it "
                f"trained {before})")
    return (f"{what}: start-up takes about {startup:.0f} s and {step_text}, so a requeue would do the same again; "
            f"not requeued (exit 2): {ask}")


def slurm_time_limit(job_id: str | None) -> tuple[float, float] | None:
    """(time limit, run time) of a Slurm job in seconds, from ``scontrol show job``; None where
    there is none (no Slurm job, UNLIMITED, scontrol unavailable)."""
    if not job_id:
        return None
    try:
        shown = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    fields = dict(word.split("=", 1) for word in shown.split() if "=" in word)
    limit, elapsed = slurm_seconds(fields.get("TimeLimit", "")), slurm_seconds(fields.get("RunTime", ""))
    return (limit, elapsed) if limit is not None and elapsed is not None else None


def slurm_seconds(text: str) -> float | None:
    """Slurm's ``[days-]hours:minutes:seconds`` (or ``minutes:seconds``) in seconds; None otherwise."""
    days, _, clock = text.rpartition("-")
    parts = clock.split(":")
    if not all(part.isdigit() for part in parts) or not 1 <= len(parts) <= 3 or (days and not days.isdigit()):
        return None
    seconds = 0
    for part in parts:
        seconds = seconds * 60 + int(part)
    return float(seconds + int(days or 0) * 86400)
