"""Metric accumulation as sums, reduced across ranks, and the run's metric writers.

Ranks accumulate sums (a task decides which: loss x samples, correct predictions, samples, ...)
and the job reduces the sums, never per-rank means: with uneven shards a mean of means is biased.
"""

from __future__ import annotations

import json
import sys
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
        self.lost: dict[str, int] = {}
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(logdir=str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a write that fails (a full disk, a quota, a vanished mount) costs the
        record, not the run: one warning per output, and the count at the end."""
        line = json.dumps(record, sort_keys=False) + "\n"
        try:
            with self.path.open("a") as handle:
                handle.write(line)
        except OSError as error:
            self.failed("metrics.jsonl", error)
        if self.tb is not None:
            try:
                split = record["split"]
                for key, value in record.items():
                    if key not in ("split", "epoch", "step") and isinstance(value, (int, float)):
                        self.tb.add_scalar(f"{split}/{key}", value, global_step=record["epoch"])
                self.tb.flush()
            except OSError as error:
                self.failed("tensorboard", error)

    def failed(self, output: str, error: OSError) -> None:
        self.lost[output] = self.lost.get(output, 0) + 1
        if self.lost[output] == 1:
            print(f"hvdtrain: warning: writing {output} in {self.path.parent} failed ({error.strerror or error}); "
                  f"training goes on, and the records it could not take are counted", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as error:
                self.failed("tensorboard", error)
        for output, count in self.lost.items():
            print(f"hvdtrain: warning: {count} record(s) could not be written to {output} in {self.path.parent}",
                  file=sys.stderr, flush=True)
