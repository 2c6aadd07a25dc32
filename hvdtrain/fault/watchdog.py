"""No silent hangs: the progress watchdog.

Every rank runs a watchdog thread that, armed during the training and validation loops, ends the
process when no step or batch has completed for ``dist.timeout_seconds``. Before it gives up it
asks every peer's liveness service (fault/liveness.py) whether it is alive and prints one line
naming the ranks (and hosts, and process ids) that did not answer, then exits 75 (the same command
resumes from the last checkpoint; 1 where every rank answers): the launcher tears the job down.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Callable, Iterator

from .. import outcome

# The liveness service's names, as callers knew them here before it had a module of its own.
from .liveness import (  # noqa: F401 (re-exported)
    PING,
    PONG,
    LivenessService,
    Peer,
    listen_addresses,
    lost_message,
    lost_peers,
    ping,
    proof,
)


class Watchdog:
    """Ends the process when an armed loop makes no progress for ``timeout`` seconds, or, armed or not,
    ``timeout`` seconds after a stop signal the ranks have not agreed on (``stop_pending``): a rank
    looping in data code never reaches the step boundary where it is (preemption.ignored_stop)."""

    def __init__(self, timeout: float, peers: list[Peer], own_rank: int):
        self.timeout = timeout
        self.peers = peers
        self.own_rank = own_rank
        self.last_beat = time.monotonic()
        self.armed = False
        self.stopped = threading.Event()
        self.busy_depth = 0  # inside busy(): a checkpoint being written, progress without beats
        self.stop_pending: Callable[[], float | None] | None = None
        if timeout > 0:
            threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True).start()

    def stop(self) -> None:
        """End the watching thread (the run is over; the process may start another)."""
        self.stopped.set()

    def beat(self) -> None:
        self.last_beat = time.monotonic()
        self.armed = True

    def progress(self) -> None:  # a validation batch of a run's first epoch: progress, not arming
        self.last_beat = time.monotonic()

    def disarm(self) -> None:
        self.armed = False

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Work that is progress without beats, on every rank (a checkpoint): a pending stop waits for it."""
        self.busy_depth += 1
        try:
            yield
        finally:
            self.busy_depth -= 1
            self.last_beat = time.monotonic()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 4)
        tick = time.monotonic()
        while not self.stopped.wait(interval):
            now, previous = time.monotonic(), tick
            tick = now
            if now - previous > interval + 5:
                # This process itself was suspended (SIGSTOP, a frozen VM): the silence was ours.
                self.last_beat = now
                continue
            if self.armed and now - self.last_beat > self.timeout:
                line, speak, lost = lost_message(self.peers, self.own_rank,
                                                 f"no progress for {self.timeout:g}s (dist.timeout_seconds)")
                if speak:
                    print(line, file=sys.stderr, flush=True)
                os._exit(outcome.EXIT_PREEMPTED if lost else outcome.EXIT_CRASH)
            pending = self.stop_pending() if self.stop_pending is not None else None
            if pending is not None and not self.busy_depth and now - max(pending, self.last_beat) > self.timeout:
                from .preemption import ignored_stop

                ignored_stop(self.own_rank, now - pending, self.timeout)  # ends the process
