"""A stop asked for before training can act on it: the scheduler's signals from the first line of
``python -m hvdtrain`` on, and the batch scripts' stop file.

A batch system's stop (Slurm's ``--signal=B:USR1@120`` ahead of the time limit, ``scancel
--signal``, a preemption) can come at any moment of a job's life, also while a rank is still
importing torch, seconds before the training loop installs its own handler
(fault/preemption.py). SIGUSR1's default action ends the process (Slurm: FAILED 138, not
requeued), so ``python -m hvdtrain`` catches both signals first thing (``catch``); the training
loop takes over what was caught (``caught``), and a command that does not train gives the process
its default handlers back and the signal with them (``release``).

The batch scripts (hostfiles/slurm/requeue.sh) also write the signal's name into a stop file,
``$HVDTRAIN_STOP_FILE``, in a folder only the job's user can write to: a rank that is not yet
started when the signal comes, or whose launcher cannot hand signals on yet (srun creating its
step, horovodrun starting mpirun), finds it when it asks whether to stop (``stop_file_signal``).

Light on purpose (no torch, no Horovod): it runs before either is imported.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any, Mapping

# About when this process started (python -m hvdtrain imports this module first): the start-up a
# time limit must leave room for is measured from here (fault/attempts.py).
STARTED = time.time()

# Ctrl-C too: a stop like the others (fault/preemption.py); a second one interrupts at once.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
STOP_FILE_VARIABLE = "HVDTRAIN_STOP_FILE"
# The PID of the process that takes the stop signals, in the environment of every process it starts
# from then on (loader workers, the forkserver that starts them), which leave the signals to it:
# ``hvdtrain launch`` counts those out of a rank when it waits for the rank to catch them.
TAKER_VARIABLE = "HVDTRAIN_SIGNALS_TAKER"

_caught: list[int] = []  # appended to by the handler: safe when a second signal interrupts the first
_before: dict[int, Any] = {}


def _record(signum: int, _frame: Any) -> None:
    if signum == signal.SIGINT and signal.SIGINT in _caught:
        raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait
    _caught.append(signum)


def catch() -> None:
    """From now on, SIGTERM, SIGUSR1 and a first SIGINT are recorded instead of ending the process:
    whatever this process was started with (a handler set to ignore them is replaced too), and then
    the signals are unblocked. The batch scripts start the ranks with them blocked (``env
    --block-signal``), so that one sent before this line waits, pending, for the handler instead of
    ending the interpreter at its start."""
    if _before:
        return
    mark_helpers()
    for sig in STOP_SIGNALS:
        _before[sig] = signal.signal(sig, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def mark_helpers() -> None:
    """The processes this one starts from now on carry its PID (``TAKER_VARIABLE``): they are its
    helpers, which leave the stop signals to it, and no rank of their own."""
    os.environ[TAKER_VARIABLE] = str(os.getpid())


def catching() -> bool:
    return bool(_before)


def caught() -> int | None:
    """The first stop signal caught since ``catch``, or None."""
    return _caught[0] if _caught else None


def release() -> None:
    """The handlers from before ``catch`` back; a signal caught meanwhile is then delivered again,
    so that a command that does not train ends on it as it would have."""
    if not _before:
        return
    for sig, handler in _before.items():
        signal.signal(sig, handler)
    _before.clear()
    first = caught()
    _caught.clear()
    if first is not None:
        os.kill(os.getpid(), first)


def stop_file_signal(env: Mapping[str, str] | None = None) -> str | None:
    """The signal name a batch script wrote into ``$HVDTRAIN_STOP_FILE`` (``TERM``), or None
    while there is no such file. Anything but a signal's name in it reads as ``TERM``."""
    path = (os.environ if env is None else env).get(STOP_FILE_VARIABLE, "")
    if not path:
        return None
    try:
        with open(path, "rb") as handle:
            text = handle.read(32).decode(errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError:
        return "TERM"  # there but unreadable: it was written to stop us
    name = text.removeprefix("SIG")
    return name if re.fullmatch(r"[A-Z0-9]{2,8}", name) else "TERM"


def tell_batch_script(run_dir: str | os.PathLike, env: Mapping[str, str] | None = None) -> None:
    """The run folder, for a batch script's line on how to continue the run in a new job
    (hostfiles/slurm/requeue.sh): ``run_dir`` beside ``$HVDTRAIN_STOP_FILE``, in the script's
    folder that only this user can write to (never through a link); nothing where no script set one."""
    stop_file = (os.environ if env is None else env).get(STOP_FILE_VARIABLE, "")
    if not stop_file:
        return
    try:
        descriptor = os.open(os.path.join(os.path.dirname(stop_file), "run_dir"),
                             os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(os.path.abspath(run_dir))
    except OSError:
        pass
