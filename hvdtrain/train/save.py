"""Checkpoints of a run: the payload every rank contributes, the cross-rank audit before it, and the write
(rank 0), with a full disk said in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from .. import outcome
from ..checkpoint import io as checkpoint
from ..comm import dist
from ..comm.dist import log
from ..config import to_dict
from ..fault.audit import audit
from .guard import JobStopped
from .run import Run, where
from .stops import LostRank


def checkpoint_payload(run: Run) -> dict[str, Any]:
    """Everything needed to continue exactly where the run is now (a collective: call on every rank)."""
    payload = run.state.state_dict()
    payload.update(
        format=checkpoint.FORMAT,
        ranks=dist.allgather_object(run.state.rank_state(), name="hvdtrain.checkpoint.io.ranks"),
        world_size=dist.size(),
        global_batch=run.global_batch,
        lr=run.settings.current_lr(run.state),
        task={"name": run.task.name, **run.task.checkpoint_metadata()},
        config=to_dict(run.cfg),
    )
    if run.state.position.step_in_epoch and run.train_sums_so_far is not None:
        payload["train_sums"] = run.train_sums_so_far()  # the interrupted epoch's metrics, on resume
    return payload


def audit_ranks(run: Run, where: str, floating_buffers: bool = False) -> None:
    """The cross-rank audit (fault/audit.py; a collective): under ``runtime.audit=stop`` a difference ends the
    job on every rank with one line from rank 0, under ``warn`` rank 0 says it and the run goes on."""
    if run.cfg.runtime.audit == "off":
        return
    line = audit(run.state, where, floating_buffers, optimizer_state=run.cfg.dist.op != "adasum")
    if line is None:
        return
    if run.cfg.runtime.audit == "warn":
        log(f"hvdtrain: warning: {line}; going on (runtime.audit=warn)")
        return
    run.watchdog.disarm()
    raise LostRank(f"hvdtrain: {line}; stopping before anything else is written (runtime.audit=warn only warns)",
                   speak=dist.is_primary())


class DiskFullStop(JobStopped):
    """The job's stop because a checkpoint that had to be written did not fit (the last epoch's, or a
    stop's; rank 0's writer raised checkpoint.DiskFull): every rank ends with exit code 74 (EX_IOERR),
    which says to a scheduler that a retry as it is will not help."""

    exit_code = outcome.EXIT_DISK_FULL


def save_checkpoint(run: Run, saver: checkpoint.CheckpointSaver | None, is_best: bool = False,
                    audited: bool = False, must: bool = False,
                    on_saved: Callable[[Path | None], None] | None = None) -> Path | None:
    """Every rank takes part (random states and buffers are collected); rank 0 writes. The ranks are
    audited first (unless the caller just did): a checkpoint of diverged ranks is never written.

    A checkpoint that does not fit on its file system (checkpoint.DiskFull) is said in one line,
    and nothing is lost: the older checkpoints stay as they were. Training goes on and the next
    checkpoint tries again, unless this one is the last chance (``must``: the final epoch's, or a
    stop's), which ends the job on every rank with DiskFullStop (exit code 74).

    ``on_saved(path)`` runs on each rank as soon as its part of the write is done (path None where
    nothing was written), before the ranks compare outcomes: the epoch's records go with the
    checkpoint that holds the epoch, so a rank lost in that round does not lose them to the resume."""
    if run.settings.guard is not None:
        run.settings.guard.check()  # a checkpoint is never written of a diverged state
    if not audited:
        audit_ranks(run, f"the checkpoint of {where(run)} (global step {run.state.position.step})")
    with run.watchdog.busy():  # a pending stop signal waits for the checkpoint (fault/watchdog.py)
        payload = checkpoint_payload(run)
        path, problem = None, None
        if saver is not None:
            try:
                path = saver.save(payload, is_best)
            except checkpoint.DiskFull as error:
                problem = error.strerror
        if on_saved is not None:
            on_saved(path)
        # Rank 0's outcome, on every rank: nobody runs ahead (or exits) before the file is in place. One
        # small broadcast says whether it failed (each collective is a round between the ranks); the
        # reason follows only then.
        failed = dist.broadcast(torch.tensor([1 if problem else 0], dtype=torch.int32),
                                name="hvdtrain.checkpoint.io.saved")
        if int(failed[0]):
            problem = dist.broadcast_object(problem, name="hvdtrain.checkpoint.io.problem")
    if problem:
        if must:
            raise DiskFullStop(f"hvdtrain: {problem}", speak=dist.is_primary())
        log(f"hvdtrain: warning: {problem}; training goes on and the next checkpoint tries again")
    return path
