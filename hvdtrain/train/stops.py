"""How a run stops early on every rank: a preemption's checkpointed stop (exit 75) and a lost rank.
"""

from __future__ import annotations

import re

from .. import outcome
from ..comm import dist
from ..fault.liveness import lost_message
from .guard import JobStopped
from .run import Run


class Preempted(Exception):
    """Raised on every rank after a signal-triggered checkpoint; the CLI exits with EXIT_PREEMPTED."""

    exit_code = outcome.EXIT_PREEMPTED  # EX_TEMPFAIL: not finished, try again


class NoProgress(Preempted):
    """A checkpointed stop after which a requeue would make no progress either (a time limit too
    short for start-up and a step: fault/attempts.no_progress_line): exit 2, not requeued."""

    exit_code = outcome.EXIT_BAD_INPUT


class LostRank(JobStopped):
    """The job cannot go on because of the other ranks: a collective failed because a peer died or
    hangs, or the ranks' states diverged (the audit). ``speak`` is set on the rank that reports it."""


class PeerLost(LostRank):
    """A collective failed because a peer is dead, hung or cut off (a pulled link): what was saved
    stands, and the same command resumes from the last checkpoint once the peer is back. Exit 75,
    as after a preemption, so that a scheduler's retry loop requeues it."""

    exit_code = outcome.EXIT_PREEMPTED


def lost_rank(run: Run, error: Exception) -> LostRank:
    """A failed collective, as the one line that names the lost rank (PeerLost where one is)."""
    run.watchdog.disarm()
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    first_line = re.sub(r"\[[^\]]*\]\s*", "", first_line).strip()  # drop "[file.cc:81]" prefixes
    line, speak, lost = lost_message(run.peers, dist.rank(), f"a collective failed ({first_line[:100]})")
    return (PeerLost if lost else LostRank)(line, speak)
