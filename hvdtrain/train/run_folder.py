"""Where a run writes (``output.dir``), when the user does not say.

Every job started from one folder used to share ``runs/hvdtrain``, and automatic resume continued
whatever another job had left there. ``output.dir=auto`` (the default) names the job instead:

- under Slurm, ``runs/<job name>-<job id>`` below the folder the job runs in. Slurm keeps the job
  id when it requeues a job (``scontrol requeue``, ``--requeue`` after a node failure), so the
  requeued job finds its own checkpoints and resumes; another job gets another folder.
- elsewhere, ``runs/hvdtrain``: outside a scheduler nothing names a job and stays the same when
  it is run again, and running the same command again is how a stopped run resumes (75). A
  different run there stops with one line naming what differs (checkpoint/identity.py); give each its
  own ``output.dir``.

Light on purpose (no torch, no Horovod): the config is resolved before either is imported.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Callable, Mapping

AUTO = "auto"
OUTSIDE_SLURM = "runs/hvdtrain"


def default_output_dir(env: Mapping[str, str] | None = None) -> str:
    """``runs/<job name>-<job id>`` under Slurm, ``runs/hvdtrain`` elsewhere (see the module docstring)."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "").strip()
    if not job_id:
        return OUTSIDE_SLURM
    # A job name is the user's free text (a script name, "my run/2"): one folder name of it.
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", env.get("SLURM_JOB_NAME", "").strip()).strip("._") or "job"
    return f"runs/{name}-{re.sub(r'[^0-9_]+', '', job_id) or job_id}"


def resolve_output_dir(output_dir: str, env: Mapping[str, str] | None = None) -> str:
    """``output_dir`` itself, or the default folder for ``auto``."""
    return default_output_dir(env) if output_dir == AUTO else output_dir


def output_dir_problem(path: Path) -> str | None:
    """None when ``path`` exists as a folder (created here if need be) that this user can write to,
    else one line naming the folder, what is wrong and the fix."""
    fix = ("run from a folder you can write to (sbatch runs the job in the folder you submit from) "
           "or set output.dir=/a/folder/of/yours")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create the output folder '{path.absolute()}' ({error.strerror or error}): {fix}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the output folder '{path.absolute()}' is not writable by this user: {fix}"
    return None


def prepare_output_dir(path: Path, is_primary: bool, broadcast: Callable[[object], object] | None) -> str | None:
    """Rank 0 creates the run folder and checks it; every rank gets its one-line problem (or None),
    so that all of them stop together instead of waiting in a collective for a rank that crashed.

    Without ``broadcast`` (elastic runs: a worker that joins later must not call a collective its
    running peers are not in), only rank 0 checks; its error ends its process, and Horovod Elastic
    ends the job when no rank is left to carry it."""
    problem = output_dir_problem(path) if is_primary else None
    return problem if broadcast is None else broadcast(problem)
