"""``hvdtrain launch``'s signal forwarding: a stop signal the launcher gets goes to this host's
ranks once they catch it (``Forwarder``), found by the launcher's token in their environment.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..fault.signals import TAKER_VARIABLE
from .records import TOKEN_VARIABLE

RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")  # set by horovodrun --gloo, by mpirun


def local_ranks(launcher_pid: int, token: str) -> dict[int, tuple[int, str]]:
    """The job's ranks on this host, with any shell a rank was started through: the launcher's
    descendants whose environment has the job's token and a rank variable, as pid -> (parent pid,
    rank). horovodrun, its shell and mpirun carry the token but no rank variable. A rank's helpers
    (its loader workers, the forkserver that starts them), which leave the stop signals to the rank
    and never catch them, carry the rank's PID (``TAKER_VARIABLE``, fault/signals.py) and are left
    out; loader workers a rank forks (``data.mp_context=fork``) show its start-up environment and
    stay in, as the rank's children (``Forwarder.ready``)."""
    import psutil  # Horovod's own dependency; main() imports it before any signal can come

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return {}
    found, takers = {}, {}
    for child in children:
        try:
            environ = child.environ()
            parent = child.ppid()
        except psutil.Error:
            continue
        rank = next((environ[name] for name in RANK_VARIABLES if name in environ), None)
        if environ.get(TOKEN_VARIABLE) == token and rank is not None:
            found[child.pid] = (parent, rank)
            takers[child.pid] = environ.get(TAKER_VARIABLE, "")
    return {pid: found[pid] for pid in found
            if not (takers[pid].isdigit() and int(takers[pid]) != pid and int(takers[pid]) in found)}


def disposition(pid: int, signum: int, proc: Path = Path("/proc")) -> str:
    """What process ``pid`` does with ``signum`` now: ``caught`` (a handler), ``ignored`` or
    ``default`` (ends on it), from ``SigCgt``/``SigIgn`` of its status. A rank just started is still
    importing Python, and hvdtrain's handler comes with its first line (fault/signals.py). A
    process that is gone counts as ``caught``: nothing to wait for."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return "caught"
    masks = dict(re.findall(r"^(SigCgt|SigIgn):\s*([0-9a-fA-F]+)$", status, re.MULTILINE))
    bit = 1 << (signum - 1)
    if int(masks.get("SigCgt", "0"), 16) & bit:
        return "caught"
    return "ignored" if int(masks.get("SigIgn", "0"), 16) & bit else "default"


class Forwarder:
    """Hands a stop signal the launcher gets (a scheduler's, a batch script's) to this host's ranks,
    which agree on it with the others and checkpoint: horovodrun would end them instead (under
    mpirun within a second, under Gloo within 5 s). With no rank on this host, horovodrun gets it.

    The handler only writes the signal's number into a pipe; a thread of its own does the rest.
    A second signal while the first is handled (a batch shell and its helper step both passing
    one on, ``scontrol requeue``) is absorbed: the ranks are stopping already; but a second Ctrl-C
    interrupts at once, as it does a single process (exit 130). Ranks still starting
    get the signal once all of this host's have started and catch it (``disposition``): until then
    it would end them, and one that has not started would only hear of the stop from the others."""

    READY_WAIT_SECONDS = 30.0  # a program that never catches it (not hvdtrain's CLI) gets it then

    def __init__(self, job: subprocess.Popen, token: str, expected_here: int | None) -> None:
        self.job, self.token, self.expected_here = job, token, expected_here
        self.ranks_here = expected_here is None or expected_here > 0
        self.read_end, self.write_end = os.pipe()
        self.first: int | None = None
        self.thread = threading.Thread(target=self.run, name="hvdtrain-launch-forward", daemon=True)

    def handler(self, signum: int, _frame) -> None:
        with contextlib.suppress(OSError):
            os.write(self.write_end, bytes([signum]))

    def start(self) -> "Forwarder":
        self.thread.start()
        return self

    def run(self) -> None:
        while True:
            signum = self.next_signal(None)
            if signum is None:
                return
            if self.first is None:
                self.first = signum
                self.deliver(signum)
            else:
                self.again(signum)

    def next_signal(self, timeout: float | None) -> int | None:
        """The next signal the handler wrote (None: none within ``timeout``, or the pipe closed)."""
        if timeout is not None and not select.select([self.read_end], [], [], timeout)[0]:
            return None
        try:
            data = os.read(self.read_end, 1)
        except OSError:
            return None
        return data[0] if data else None

    def again(self, signum: int) -> None:
        """A signal after the first: absorbed, but for a second Ctrl-C, which interrupts at once
        (the ranks' own second SIGINT, and horovodrun's: exit 130, no checkpoint)."""
        if signum == signal.SIGINT and self.first == signal.SIGINT and self.job.poll() is None:
            self.kill(list(local_ranks(self.job.pid, self.token)), signum)
            with contextlib.suppress(OSError):
                self.job.send_signal(signum)

    def deliver(self, signum: int) -> None:
        """Once every rank here catches ``signum`` (the innermost processes of the ranks' trees: a
        shell a rank runs under waits for its Python), it goes to the processes that catch it; a
        shell is left alone (ending it would end its rank). One line says when it went (``said``)."""
        came = time.monotonic()
        deadline = came + self.READY_WAIT_SECONDS
        looks = 0
        while self.job.poll() is None:
            looks += 1
            ranks = local_ranks(self.job.pid, self.token) if self.ranks_here else {}
            parents = {parent for parent, _ in ranks.values()}
            innermost = [pid for pid in ranks if pid not in parents]
            started = len({rank for _, rank in ranks.values()})
            # Whether a rank is ready is read from SIGTERM, whatever the signal: hvdtrain catches the
            # stop signals together on its first line, while Python catches SIGINT from its own start
            # (KeyboardInterrupt, which would end a rank still importing).
            if innermost and started >= (self.expected_here or 1) \
                    and all(self.ready(pid, ranks, signal.SIGTERM) for pid in innermost):
                self.kill([pid for pid in ranks if disposition(pid, signal.SIGTERM) == "caught"], signum)
                self.said(signum, ranks, "at once, all of them catching it" if looks == 1 else
                          f"after {time.monotonic() - came:.1f} s, once all had started and caught it")
                return
            if not self.ranks_here or time.monotonic() > deadline:
                self.kill(list(ranks), signum)
                if not ranks:
                    with contextlib.suppress(OSError):
                        self.job.send_signal(signum)
                elif self.ranks_here:
                    self.said(signum, ranks, f"after waiting {self.READY_WAIT_SECONDS:.0f} s for all of them "
                                             "to catch it (one that does not ends on it)")
                return
            later = self.next_signal(0.05)  # ranks still starting: /proc says when they catch it
            if later is not None:
                self.again(later)
                if later == signal.SIGINT and self.first == signal.SIGINT:
                    return

    @staticmethod
    def said(signum: int, ranks: dict[int, tuple[int, str]], when: str) -> None:
        """The launcher's line for a stop signal handed on: which, to which ranks, and when."""
        numbers = sorted({rank for _, rank in ranks.values()}, key=lambda rank: int(rank) if rank.isdigit() else -1)
        print(f"hvdtrain launch: {signal.Signals(signum).name} passed on to rank{'s' * (len(numbers) > 1)} "
              f"{', '.join(numbers)} on this host {when}", file=sys.stderr, flush=True)

    @staticmethod
    def ready(pid: int, ranks: dict[int, tuple[int, str]], signum: int) -> bool:
        """A rank's process catches the signal; a loader worker (a rank's child) ignores it while
        its rank catches it."""
        here = disposition(pid, signum)
        if here == "caught":
            return True
        parent = ranks[pid][0]
        return here == "ignored" and parent in ranks and disposition(parent, signum) == "caught"

    @staticmethod
    def kill(pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    def close(self) -> None:
        os.close(self.write_end)
        self.thread.join(timeout=5)
        os.close(self.read_end)
