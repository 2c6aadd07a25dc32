"""Metric accumulation as sums, reduced across ranks, and the run's metric writers.

Ranks accumulate sums (a task decides which: loss x samples, correct predictions, samples, ...)
and the job reduces the sums, never per-rank means: with uneven shards a mean of means is biased.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch


class MetricSums:
    """Running sums for one split of one epoch on one rank.

    Kept on the batch's device in float64 (exact counts), so accumulating never waits for the GPU;
    the host sees them once, when they are reduced.
    """

    def __init__(self, width: int):
        self.width = width
        self.values: torch.Tensor | None = None

    def add(self, row: torch.Tensor) -> None:
        self.values = row if self.values is None else self.values + row

    def local(self) -> torch.Tensor:
        """This rank's sums so far, on the host."""
        return torch.zeros(self.width, dtype=torch.float64) if self.values is None else self.values.cpu()

    def reduced(self, allreduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The sums of every rank (a collective)."""
        return allreduce_sum(self.local())


class MetricsWriter:
    """metrics.jsonl (one object per split per epoch) and tensorboardX scalars, on rank 0 only."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = run_dir / "metrics.jsonl"
        self.tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(logdir=str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(record, sort_keys=False) + "\n")
        if self.tb is not None:
            split = record["split"]
            for key, value in record.items():
                if key not in ("split", "epoch", "step") and isinstance(value, (int, float)):
                    self.tb.add_scalar(f"{split}/{key}", value, global_step=record["epoch"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
