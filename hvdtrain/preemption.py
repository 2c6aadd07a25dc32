"""Graceful stop on SIGTERM / SIGUSR1 (what Slurm, Kubernetes and most schedulers send).

The signal handler only records the request. At every step boundary the ranks agree on it with
one tiny allreduce, so a signal that reaches a single rank still stops every rank at the same step,
and no rank is left waiting in a collective.
"""

from __future__ import annotations

import contextlib
import signal
from typing import Iterator

import torch

from . import dist

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    def __init__(self) -> None:
        self.received: int | None = None

    def _handler(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.received = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator["StopRequest"]:
        previous = {sig: signal.signal(sig, self._handler) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def agreed(self) -> bool:
        """True on every rank as soon as any rank has received a stop signal (a collective)."""
        local = torch.tensor([1.0 if self.received else 0.0], dtype=torch.float64)
        return bool(dist.allreduce_sum(local, name="hvdtrain.stop_request")[0] > 0)

    def reason(self) -> str:
        return signal.Signals(self.received).name if self.received else "a stop signal sent to another rank"
