"""Graceful stop on SIGTERM / SIGUSR1 (what Slurm, Kubernetes and most schedulers send), SIGINT
(Ctrl-C), or a cloud's spot/preemption notice (runtime.preemption_notice; fault/spot.py polls for it
on a thread). The stop line names the signal that came first.

The signal handler (or the notice thread) only records the request. At step boundaries the ranks
agree on it with one tiny allreduce, so a signal that reaches a single rank still stops every rank
at the same step, and no rank is left waiting in a collective.

That allreduce can be waited for at the boundary (``agreed``), or sent at one boundary and read at a
later one (``agreed(wait=False)``), while the steps in between run. The second does not stall each
step for a round between the ranks, and still gives every rank the same answer at the same
boundary. It is
sent about every ``AGREE_EVERY_SECONDS`` of training, not at every step: each answer also carries
the ranks' time since the last one, from which every rank computes the same number of boundaries to
the next (``StopRequest.every``). Where steps take longer than that, it is every step, read one step
later; where they take milliseconds, a separate coordination round per step would still cost
10-29% of the step (the digits model on 2 CPU ranks, benchmarks/stop_agreement.py: 9.82 ms a step
with the gradients' allreduce alone, 13.07 ms with a stop agreement at every step, 9.87 ms with one
about every half second). A stop is then seen within about twice that time, a second at most,
far inside any scheduler's grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Iterator

import torch

from .. import outcome
from ..comm import dist
from ..comm import launcher_env as launcher
from . import signals
from .spot import NoticeWatcher

# Ctrl-C (SIGINT) stops a run the same way: a checkpoint at the next step boundary, exit 75, the
# line naming SIGINT; a second Ctrl-C while the first is pending interrupts at once (exit 130).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# About how often, in seconds of training, an agreement that is not waited for is sent.
AGREE_EVERY_SECONDS = 0.5
# The most boundaries between two such agreements, whatever the steps' speed.
MOST_BOUNDARIES_BETWEEN = 1000


class StopRequest:
    def __init__(self, notice: str = "none", notice_url: str = "", poll_seconds: float = 5.0) -> None:
        self.received: int | str | None = None  # a signal number, or a cloud notice's line
        self.received_at: float | None = None   # when the first stop signal came (time.monotonic)
        self.acted = False  # the ranks agreed on the stop: the loop checkpoints and leaves
        self.from_file = False  # received: the batch script's stop file (a signal, told as text)
        self.notice, self.notice_url, self.poll_seconds = notice, notice_url, poll_seconds
        self.everywhere: torch.Tensor | None = None  # [ranks with a signal, ranks with a notice]
        self.before_early: dict = {}  # the process's own handlers while keep_early() holds them
        self.extra: torch.Tensor | None = None  # the sum of what the caller added to the last agreement
        self.in_flight: int | None = None  # the handle of an agreement sent with wait=False, not yet read
        # Agreements sent with wait=False: one every `every` boundaries (the same on every rank: it is
        # computed from the summed answers), `since_sent` boundaries since the last, sent at `sent_at`.
        self.interval_seconds = AGREE_EVERY_SECONDS
        self.every, self.since_sent, self.sent_at = 1, 0, 0.0

    @classmethod
    def for_config(cls, runtime) -> "StopRequest":
        return cls(runtime.preemption_notice, runtime.preemption_notice_url, runtime.preemption_poll_seconds)

    def _on_notice(self, line: str) -> None:
        self.received = self.received or line

    def _handler(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the checkpoint
        # The first signal is the cause: a launcher that ends the job after a Ctrl-C (horovodrun sends
        # SIGTERM) must not rename it.
        if not isinstance(self.received, int):
            self.received = signum
        self.received_at = self.received_at or time.monotonic()

    def pending_since(self) -> float | None:
        """When a stop signal came that the ranks have not yet agreed on (None: none, or agreed): the
        watchdog ends a rank that makes no progress for dist.timeout_seconds from then on."""
        signalled = isinstance(self.received, int) or self.from_file
        return None if self.acted or not signalled else self.received_at

    def keep_early(self) -> None:
        """From now until ``installed()`` (start-up: building the loaders, resuming), a stop signal is
        kept rather than fatal (SIGUSR1's default action ends the process): the run then stops at
        its first step boundary, with exit 75, like a signal that comes later. A batch system's
        signal ahead of the time limit can come at any moment of a short job; one that came while
        ``python -m hvdtrain`` was still importing (fault/signals.py) is taken over here.
        ``release_early()`` gives the process its handlers back."""
        signals.mark_helpers()  # a loop of the user's own, not started by python -m hvdtrain
        self.before_early = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        if self.received is None and signals.caught() is not None:
            self.received, self.received_at = signals.caught(), time.monotonic()

    def release_early(self) -> None:
        for sig, handler in self.before_early.items():
            signal.signal(sig, handler)
        self.before_early = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        signals.mark_helpers()
        previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        watcher = None
        if self.notice != "none":
            # Every rank polls its own host's endpoint; one line per host says where, or that it is silent.
            say = (lambda line: print(line, flush=True)) if launcher.local_rank() == 0 else None
            watcher = NoticeWatcher(self.notice, self.notice_url, self.poll_seconds, self._on_notice, say).start()
        try:
            yield self
        finally:
            if watcher is not None:
                watcher.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def agreed(self, extra: torch.Tensor | None = None, wait: bool = True) -> bool:
        """True on every rank as soon as any rank has received a stop signal or notice (a collective).
        ``extra``: float64 values of this rank summed over ranks in the same allreduce (``self.extra``),
        e.g. the counts of failed files that bad_data.DataGuard stops on.

        ``wait=False`` (no ``extra``): at every ``self.every``-th boundary, the answer sent at the last
        such boundary is read and this boundary's is sent without waiting for it; at the others,
        nothing is sent and the answer is False. A stop is seen up to ``2 * every`` boundaries later
        (``every`` is 1 where steps take ``interval_seconds`` or more). Every rank must call with the
        same ``wait`` at the same boundary, and ``settle()`` before the loop does anything else
        collective that could meet a stop (the end of the steps)."""
        if not wait:
            assert extra is None, "counts that decide a stop before the next step cannot wait a step"
            self.since_sent += 1
            if self.in_flight is not None and self.since_sent < self.every:
                return False  # most boundaries of short steps: nothing to build or send
            timed = self.in_flight is not None  # the time since the last send is all steps
            stop = self.settle()
            if not stop:
                now = time.perf_counter()
                # [signal, notice, milliseconds since the last send, boundaries since it]: integers,
                # whose float64 sum is exact and therefore the same on every rank.
                timing = [round((now - self.sent_at) * 1000.0), self.since_sent] if timed else [0, 0]
                self.in_flight = dist.allreduce_sum_async(
                    torch.cat([self.local(), torch.tensor(timing, dtype=torch.float64)]),
                    name="hvdtrain.stop_request.ahead")
                self.sent_at, self.since_sent = now, 0
            return stop
        if self.settle():
            return True
        local = self.local()
        if extra is not None:
            local = torch.cat([local, extra.to(torch.float64)])
        summed = dist.allreduce_sum(local, name="hvdtrain.stop_request" if extra is None else "hvdtrain.stop_request+")
        self.everywhere, self.extra = summed[:2], (summed[2:] if extra is not None else None)
        return bool(self.everywhere.sum() > 0)

    def settle(self) -> bool:
        """Read the answer still on its way (``agreed(wait=False)``), if any: whether it says stop."""
        if self.in_flight is None:
            return False
        handle, self.in_flight = self.in_flight, None
        summed = dist.wait(handle)
        self.everywhere = summed[:2]
        milliseconds, boundaries = float(summed[2]), float(summed[3])
        if boundaries > 0:  # every rank computes the same interval from the same sums
            self.every = int(max(1.0, min(float(MOST_BOUNDARIES_BETWEEN),
                                          self.interval_seconds * 1000.0 * boundaries // max(milliseconds, 1.0))))
        return bool(self.everywhere.sum() > 0)

    def local(self) -> torch.Tensor:
        """This rank's part of an agreement: [a stop signal received, a notice seen]. A batch
        script's stop file (fault/signals.py) counts as its signal."""
        if self.received is None:
            named = signals.stop_file_signal()
            if named is not None:
                self.received = f"SIG{named} (to the batch script)"
                self.from_file, self.received_at = True, self.received_at or time.monotonic()
        signalled = isinstance(self.received, int) or self.from_file
        noticed = isinstance(self.received, str) and not self.from_file
        return torch.tensor([1.0 if signalled else 0.0, 1.0 if noticed else 0.0], dtype=torch.float64)

    def reason(self) -> str:
        if isinstance(self.received, str):
            return self.received
        if self.received:
            name = signal.Signals(self.received).name
            return f"{name} (Ctrl-C)" if self.received == signal.SIGINT else name
        if self.everywhere is not None and self.everywhere[1] > 0:
            return f"a preemption notice ({self.notice}) seen by another rank"
        return "a stop signal sent to another rank"


def ignored_stop(rank: int, waited: float, timeout: float) -> None:
    """End this process: a stop signal came ``waited`` seconds ago and the rank has made no progress
    for ``timeout`` since (called from the watchdog's thread). The rank is stuck where the stop is
    never checked, such as a loop in data code; the main thread's place is named. No checkpoint is
    written (the stuck state cannot be saved): the run resumes from its last one. Exit code 75."""
    main = threading.main_thread().ident
    frame = sys._current_frames().get(main) if main is not None else None
    where = f" in {frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})" if frame is not None else ""
    print(f"hvdtrain: stop signal received {waited:.0f} s ago, but rank {rank} has made no progress for {timeout:g} s "
          f"(dist.timeout_seconds): it is stuck{where}. Ending it without a checkpoint; the run resumes from its "
          f"last one with the same command.", file=sys.stderr, flush=True)
    outcome.note_cause("stop signal ignored: stuck" + where)
    outcome.write_exit_record(outcome.EXIT_PREEMPTED)
    os._exit(outcome.EXIT_PREEMPTED)
