"""How a job ends, for the CLI and the Python API alike: the user's errors in one line once per
job, one exit code per way a run stops, and the one-line cause that ``hvdtrain launch`` reports.

    0   finished                      2   bad configuration, data, task or checkpoint
    75  stopped after a checkpoint    1   a rank was lost, or a crash
    74  a checkpoint that had to be written did not fit on its disk (EX_IOERR: not for a blind retry)
    65  data files vanished: training files past data.max_bad_fraction or a tar shard (stopped after a
        checkpoint of the last good step), or validation files past it (after the epoch's training is
        checkpointed) (EX_DATAERR: restore the data, then run the same command; a retry before that fails again);
        or a data set's own files hold a value that cannot be right (a manifest's count, a shard's name:
        data.DamagedData), said in one line before training
    130 interrupted (Ctrl-C)

Light on purpose (no torch, no Horovod): the CLI reports a usage error through it before either
is imported.
"""

from __future__ import annotations

import socket
import sys
import time

from .arguments import UsageError
from .comm import launcher_env as launcher
from .config import ConfigError
from .data import DataError
from .environment import EnvironmentProblem
from .ownership import UnsafePath

EXIT_OK, EXIT_CRASH, EXIT_BAD_INPUT, EXIT_DISK_FULL, EXIT_PREEMPTED, EXIT_INTERRUPTED = 0, 1, 2, 74, 75, 130
EXIT_DATA_VANISHED = 65

# This process's one-line cause of a non-zero exit, for its exit record (launch/horovodrun.py).
_cause = [""]


def note_cause(text: str) -> None:
    _cause[0] = text


def cause() -> str:
    return _cause[0]


# How long a rank other than 0 waits before it prints an error or a traceback that every rank may
# hit alike: rank 0 prints it, exits, and the launcher ends the others within this time. 3 s was
# not always enough on a loaded 2-core machine (in CI rank 0 had not exited 3 s after rank 1's crash);
# a rank that alone failed says so this much later.
PEER_PAUSE_SECONDS = 10.0


def user_errors() -> tuple[type[Exception], ...]:
    """Errors that are the user's to fix: reported in one line, without a traceback.

    A CheckpointError can only come from hvdtrain.checkpoint.io once it is loaded; importing it just
    to name the class would load torch on the way to a one-line usage error.
    """
    checkpoint = sys.modules.get(f"{__package__}.checkpoint.io")
    return ((UsageError, ConfigError, DataError, UnsafePath, EnvironmentProblem)
            + ((checkpoint.CheckpointError,) if checkpoint else ()))


def report_error(error: Exception) -> int:
    """One line on stderr, once per job; returns the exit code for bad input (2), or the error's own
    ``exit_code`` (65 for a data set's own files holding values that cannot be right: DamagedData).

    Errors that every rank hits alike (a bad config, a missing folder) would print once per rank;
    ranks other than 0 wait a moment first, and the launcher ends them when rank 0 exits, so the
    line from another rank only shows when that rank alone failed.
    """
    rank = launcher.rank()
    if rank != 0:
        time.sleep(PEER_PAUSE_SECONDS)
        print(f"hvdtrain: error on rank {rank} ({socket.gethostname()}): {error}", file=sys.stderr, flush=True)
    else:
        print(f"hvdtrain: error: {error}", file=sys.stderr, flush=True)
    note_cause(f"error: {error}")
    return int(getattr(error, "exit_code", EXIT_BAD_INPUT))


def stop_code(stop: Exception) -> int:
    """The exit code of a run that stopped early (run.Preempted: 75; run.JobStopped, e.g. a lost
    rank: its own code), after its line where this rank is the one to say it."""
    if getattr(stop, "speak", False):
        print(stop, file=sys.stderr, flush=True)
    if getattr(stop, "speak", True):  # a preemption has no speaker: rank 0 logged it already
        note_cause(str(stop))
    return int(getattr(stop, "exit_code"))


def crash_cause(error: BaseException) -> None:
    """Note an unexpected exception's first line as the cause; ranks other than 0 then pause, so
    that a traceback every rank hits alike shows once (the launcher ends them when rank 0 exits)."""
    note_cause(f"{type(error).__name__}: {error}".splitlines()[0])
    if launcher.size() > 1 and launcher.rank() != 0:
        time.sleep(PEER_PAUSE_SECONDS)


def write_exit_record(code: int) -> None:
    """This rank's exit record for ``hvdtrain launch`` (nothing outside it, or for code 0)."""
    from .launch.records import record_exit

    record_exit(launcher.rank(), code, cause())
