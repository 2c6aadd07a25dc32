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
import socket
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..comm import dist
from .. import outcome
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


def record_end(run_dir: Path, error: BaseException | None, epoch: int, step: int, share: str = PRIVATE) -> None:
    """Rank 0: the line of this attempt's end, ``error`` being what ended the loop (None: finished)."""
    if dist.is_primary():
        code, reason = exit_of(error)
        append(run_dir, {"event": "end", "time": now(), **job_identity(), "exit": code, "reason": reason[:500],
                         "epoch": epoch, "step": step}, share)
