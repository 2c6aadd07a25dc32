"""Graceful stop on SIGTERM / SIGUSR1 (what Slurm, Kubernetes and most schedulers send), or on a
cloud's spot/preemption notice (runtime.preemption_notice; fault/spot.py polls for it on a thread).

The signal handler (or the notice thread) only records the request. At every step boundary the ranks agree on it with
one tiny allreduce, so a signal that reaches a single rank still stops every rank at the same step,
and no rank is left waiting in a collective.

That allreduce can be waited for at the boundary (``agreed``) or one boundary later (``agreed(wait=False)``:
sent now, read at the next boundary, while the step's gradients are allreduced). The second does not
stall each step for a round between the ranks (on CPU ranks that round was 11% of a small model's
step: benchmarks/ddp_port.py), and still gives every rank the same answer at the same boundary; a
stop then comes one step later.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

import torch

from ..comm import dist, launcher_env as launcher
from .spot import NoticeWatcher

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self, notice: str = "none", notice_url: str = "", poll_seconds: float = 5.0) -> None:
        self.received: int | str | None = None  # a signal number, or a cloud notice's line
        self.notice, self.notice_url, self.poll_seconds = notice, notice_url, poll_seconds
        self.everywhere: torch.Tensor | None = None  # [ranks with a signal, ranks with a notice]
        self.before_early: dict = {}  # the process's own handlers while keep_early() holds them
        self.extra: torch.Tensor | None = None  # the sum of what the caller added to the last agreement
        self.in_flight: int | None = None  # the handle of an agreement sent with wait=False, not yet read

    @classmethod
    def for_config(cls, runtime) -> "StopRequest":
        return cls(runtime.preemption_notice, runtime.preemption_notice_url, runtime.preemption_poll_seconds)

    def _on_notice(self, line: str) -> None:
        self.received = self.received or line

    def _handler(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.received = signum

    def keep_early(self) -> None:
        """From now until ``installed()`` (start-up: building the loaders, resuming), a stop signal is
        kept rather than fatal (SIGUSR1's default action ends the process): the run then stops at
        its first step boundary, with exit 75, like a signal that comes later. A batch system's
        signal ahead of the time limit can come at any moment of a short job. ``release_early()``
        gives the process its handlers back."""
        self.before_early = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}

    def release_early(self) -> None:
        for sig, handler in self.before_early.items():
            signal.signal(sig, handler)
        self.before_early = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
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

        ``wait=False`` (no ``extra``): the answer sent at the previous boundary is read, and this
        boundary's is sent without waiting for it; a stop is seen one boundary later. Every rank must
        call with the same ``wait`` at the same boundary, and ``settle()`` before the loop does
        anything else collective that could meet a stop (the end of the steps)."""
        local = torch.tensor([1.0 if isinstance(self.received, int) else 0.0,
                              1.0 if isinstance(self.received, str) else 0.0], dtype=torch.float64)
        if not wait:
            assert extra is None, "counts that decide a stop before the next step cannot wait a step"
            stop = self.settle()
            if not stop:
                self.in_flight = dist.allreduce_sum_async(local, name="hvdtrain.stop_request.ahead")
            return stop
        if self.settle():
            return True
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
        self.everywhere = dist.wait(handle)
        return bool(self.everywhere.sum() > 0)

    def reason(self) -> str:
        if isinstance(self.received, str):
            return self.received
        if self.received:
            return signal.Signals(self.received).name
        if self.everywhere is not None and self.everywhere[1] > 0:
            return f"a preemption notice ({self.notice}) seen by another rank"
        return "a stop signal sent to another rank"
