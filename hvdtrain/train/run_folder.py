"""Where a run writes (``output.dir``), and which job it belongs to.

One job, one run folder. Under a scheduler (Slurm, and the other batch systems' job ids:
launch/job.py) every job gets a folder of its own unless the user names one:

- ``output.dir=auto`` (the default, and what every shipped config leaves it at) is
  ``runs/<job name>-<job id>`` below the folder the job runs in. A scheduler keeps the job id
  when it requeues a job, so the requeued job finds its own checkpoints and resumes; another
  job gets another folder.
- a folder a config *file* names is every job's that uses the file: under a scheduler the job's
  folder goes inside it (``<output.dir>/<job name>-<job id>``). A folder named on the command line
  (``output.dir=...``) or by a script (``hvdtrain.fit(config={...})``) is used as it is.
- outside a scheduler nothing names a job and stays the same when it is run again, and running
  the same command again is how a stopped run resumes (75): ``runs/<config name>``
  (``runs/hvdtrain`` without ``--config``).

Before anything is written, rank 0 claims the folder for its job (train/run_claim.py: the owner
record, the lock, the line that stops a second job that would write into it or continue its run
unasked); every rank gets the same answer (``prepare_output_dir``).

The folder itself, and what may be written in it, follow hvdtrain/ownership.py: the user's own
folder (made 0700 here, 0750 with ``output.share=group``) that nobody else can write or swap.

Light on purpose (no torch, no Horovod): the config is resolved before either is imported.
"""

from __future__ import annotations

import grp
import os
from pathlib import Path
from typing import Callable, Mapping

from ..fault import signals
from ..launch.job import Job, current
from ..ownership import GROUP, PRIVATE, UnsafePath, own_folder

# The run's claim on its folder, as callers knew it here before it had a module of its own.
from .run_claim import (  # noqa: F401 (re-exported)
    LOCK_FILE,
    OWNER_FILE,
    Claim,
    FolderRefused,
    claim_folder,
    read_owner,
    still_running,
    take_lock,
)

AUTO = "auto"
OUTSIDE_SCHEDULER = "runs/hvdtrain"


def default_output_dir(env: Mapping[str, str] | None = None, config_name: str | None = None) -> str:
    """``runs/<job name>-<job id>`` under a scheduler, ``runs/<config name>`` (or ``runs/hvdtrain``)
    elsewhere (see the module docstring)."""
    job = current(env)
    if job.id:
        return f"runs/{job.folder_name()}"
    return f"runs/{config_name}" if config_name else OUTSIDE_SCHEDULER


def resolve_output_dir(output_dir: str, env: Mapping[str, str] | None = None, config_name: str | None = None,
                       from_file: bool = False) -> str:
    """The folder this job writes to: ``output_dir`` as the user named it, the default for ``auto``,
    or, under a scheduler, the job's own folder inside a folder a config file names (``from_file``)."""
    if output_dir == AUTO:
        return default_output_dir(env, config_name)
    job = current(env)
    if from_file and job.id:
        return f"{output_dir.rstrip('/') or '/'}/{job.folder_name()}"
    return output_dir


# Fix for every output folder that cannot be used.
FIX = ("run from a folder you can write to (sbatch runs the job in the folder you submit from) "
       "or set output.dir=/a/folder/of/yours")
# The folders of a run folder that hvdtrain writes into, held to the same rule as the run folder.
SUBFOLDERS = ("checkpoints", "tb")


def output_dir_problem(path: Path, share: str = PRIVATE, tensorboard: Path | None = None) -> str | None:
    """None when ``path`` is a folder this user may write into (made here, with ``share``'s mode, if
    need be; hvdtrain/ownership.py: yours, nobody else can write or swap it), and so is each of its
    subfolders that hvdtrain writes into and that exists already, and ``tensorboard`` (the folder
    output.tensorboard_dir names); else one line naming the folder, its owner and the fix."""
    try:
        own_folder(path, share, what="output folder", fix=FIX)
        for name in SUBFOLDERS:
            if os.path.lexists(path / name):
                own_folder(path / name, share, what="output folder", fix=FIX)
        if tensorboard is not None:
            own_folder(tensorboard, share, "tensorboard folder", "set output.tensorboard_dir=/a/folder/of/yours")
    except UnsafePath as error:
        return str(error)
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the output folder '{path.absolute()}' is not writable by this user: {FIX}"
    return None


def sharing_note(path: Path, share: str) -> str:
    """What the start-up line adds about who may read the run folder: nothing when private (the
    default), the group's name when shared on purpose."""
    if share != GROUP:
        return ""
    try:
        group = grp.getgrgid(path.stat().st_gid).gr_name
    except (KeyError, OSError):
        group = "its group"
    return f" (shared with group {group} on purpose: output.share=group)"


def prepare_output_dir(path: Path, is_primary: bool, broadcast: Callable[[object], object] | None,
                       share: str = PRIVATE, resume: str = AUTO, job: Job | None = None,
                       claim: bool = True, tensorboard: Path | None = None) -> tuple[str | None, Claim | None]:
    """Rank 0 creates the run folder, checks it and claims it for this job (``claim_folder``); every
    rank gets its one-line problem (or None), so that all of them stop together instead of waiting in
    a collective for a rank that crashed. Returns (the problem, rank 0's claim).

    Without ``broadcast`` (elastic runs: a worker that joins later must not call a collective its
    running peers are not in), only rank 0 checks; its error ends its process, and Horovod Elastic
    ends the job when no rank is left to carry it."""
    problem, held = None, None
    if is_primary:
        existed = path.exists()
        problem = output_dir_problem(path, share, tensorboard)
        if problem is None and claim:
            try:
                held = claim_folder(path, resume, job, share=share)
            except FolderRefused as refused:
                problem = str(refused)
            if held is not None and not existed:
                held.made.append(path)  # removed again (if still empty) should the start fail
            if held is not None:
                signals.tell_batch_script(path)
    if broadcast is not None:
        problem = broadcast(problem)
    if problem and held is not None:
        held.release()
        held = None
    return problem, held
