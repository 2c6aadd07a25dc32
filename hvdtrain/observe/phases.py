"""Where each step's time goes, per rank, and which rank holds the others up.

A step has five phases, timed on the host clock at their boundaries (``StepClock.lap``):

    data       waiting for the next batch (the loader) and copying it to the device
    compute    forward, loss and backward (the gradient allreduce starts during backward)
    allreduce  waiting for the gradient allreduce to finish (time inside ``synchronize``)
    optimizer  unscale, clip, the optimizer step, zero_grad
    other      the rest: callbacks, checkpoints, progress lines, the stop check

On CUDA the host runs ahead of the device, so a boundary waits for the device
(``torch.cuda.synchronize``) on sampled steps only (one in ``GPU_SAMPLE_EVERY``): the fractions
come from those steps, and the cost of waiting is paid on a tenth of the steps. On CPU every step
is timed; a lap costs a clock read (well under 1% of a step: docs/performance.md).

In synchronous training every rank's wall time per step is the same, because fast ranks wait in
the allreduce. What differs is the time a rank spends outside that wait: its *busy* time (data +
compute + optimizer). ``find_stragglers`` compares each rank's busy time per step to the median.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

PHASES = ("data", "compute", "allreduce", "optimizer", "other")
BUSY = ("data", "compute", "optimizer")
LABELS = {"data": "data wait", "compute": "forward+backward", "allreduce": "allreduce wait",
          "optimizer": "optimizer", "other": "other"}
GPU_SAMPLE_EVERY = 10


class StepClock:
    """Accumulates one rank's seconds per phase over the timed steps of an epoch.

    ``begin()`` at the start of a step, ``lap(phase)`` at the end of each phase (time since the
    last lap goes to ``phase``; a phase may be lapped several times in a step, e.g. with gradient
    accumulation), ``end()`` after the step (the rest goes to ``other``). ``wait`` is called before
    each clock read on timed steps (``torch.cuda.synchronize`` on CUDA). With ``every`` > 1 only
    every ``every``-th step is timed; a disabled clock (``enabled=False``) times nothing.
    """

    def __init__(self, wait: Callable[[], None] | None = None, every: int = 1, enabled: bool = True):
        self.wait, self.every, self.enabled = wait, max(1, every), enabled
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps = 0       # steps timed
        self.begun = 0       # steps begun (timed or not)
        self.timing = False  # whether the current step is timed
        self.last = 0.0

    def begin(self) -> None:
        self.timing = self.enabled and self.begun % self.every == 0
        self.begun += 1
        if self.timing:
            self._read()

    def lap(self, phase: str) -> None:
        if self.timing:
            start = self.last
            self.seconds[phase] += self._read() - start

    def end(self) -> None:
        if self.timing:
            self.lap("other")
            self.steps += 1
            self.timing = False

    def _read(self) -> float:
        if self.wait is not None:
            self.wait()
        self.last = time.perf_counter()
        return self.last

    def summary(self) -> dict[str, float]:
        """Seconds per timed step, by phase, and the number of timed steps (this rank)."""
        steps = max(1, self.steps)
        return {**{phase: self.seconds[phase] / steps for phase in PHASES}, "steps": float(self.steps)}


NO_CLOCK = StepClock(enabled=False)


def fractions(per_step: dict[str, float]) -> dict[str, float]:
    """Seconds per step by phase -> fractions of the step (summing to 1)."""
    total = sum(per_step[phase] for phase in PHASES)
    return {phase: per_step[phase] / total if total > 0 else 0.0 for phase in PHASES}


def busy(per_step: dict[str, float]) -> float:
    return sum(per_step[phase] for phase in BUSY)


def epoch_phases(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics.jsonl fields from every rank's ``StepClock.summary()`` (with ``host`` added):
    ``phase_<name>`` (the fraction of step time, mean over ranks; flat, so tensorboard plots them),
    ``busy_ms_per_step`` (median over ranks) and ``by_rank`` (each rank's fractions and busy time)."""
    timed = [r for r in ranks if r["steps"] > 0]
    if not timed:
        return {}
    shares = [fractions(r) for r in timed]
    out: dict[str, Any] = {f"phase_{phase}": statistics.fmean(s[phase] for s in shares) for phase in PHASES}
    out["busy_ms_per_step"] = 1000 * statistics.median(busy(r) for r in timed)
    out["by_rank"] = [
        {"rank": r["rank"], "host": r["host"], "busy_ms_per_step": round(1000 * busy(r), 3),
         **{phase: round(s[phase], 4) for phase in PHASES}}
        for r, s in zip(timed, shares)]
    return out


def find_stragglers(ranks: list[dict[str, Any]], threshold: float) -> list[dict[str, Any]]:
    """Ranks whose busy time per step exceeds the median rank's by more than ``threshold`` (0.15 =
    15%), slowest first, each with the busy phase that exceeds the median of that phase the most
    (the likely cause) and that phase's share of the rank's step."""
    timed = [r for r in ranks if r["steps"] > 0]
    if len(timed) < 2 or threshold <= 0:
        return []
    median = statistics.median(busy(r) for r in timed)
    if median <= 0:
        return []
    typical = {phase: statistics.median(r[phase] for r in timed) for phase in BUSY}
    found = []
    for r in timed:
        slower = busy(r) / median - 1
        if slower > threshold:
            phase = max(BUSY, key=lambda p: r[p] - typical[p])
            found.append({"rank": r["rank"], "host": r["host"], "slower": round(slower, 4),
                          "phase": phase, "phase_fraction": round(fractions(r)[phase], 4)})
    return sorted(found, key=lambda s: -s["slower"])


def straggler_line(straggler: dict[str, Any]) -> str:
    return (f"hvdtrain: straggler: rank {straggler['rank']} on {straggler['host']} is "
            f"{100 * straggler['slower']:.0f}% slower than the median rank: "
            f"{LABELS[straggler['phase']]} {100 * straggler['phase_fraction']:.0f}% of its step")
