"""Metric accumulation as sums, reduced across ranks, and the run's metric writers.

Ranks accumulate sums (loss x images, correct predictions, images) and the job reduces the sums,
never per-rank means: with uneven shards a mean of means is biased.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

SUM_FIELDS = ("loss_sum", "correct1", "correct5", "count")


def hit_counts(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 and top-5 hits in a batch as 0-d tensors on the batch's device (no host sync).

    Top-k is capped by the number of classes.
    """
    k = min(5, logits.shape[1])
    hits = logits.topk(k, dim=1).indices.eq(targets.view(-1, 1))
    return hits[:, :1].sum(), hits.sum()


class MetricSums:
    """Running sums for one split of one epoch on one rank.

    Kept on the batch's device in float64 (exact counts), so accumulating never waits for the GPU;
    the host sees them once, when they are reduced.
    """

    def __init__(self) -> None:
        self.values: torch.Tensor | None = None

    def add(self, loss_mean: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        top1, top5 = hit_counts(logits, targets)
        count = targets.shape[0]
        row = torch.stack([loss_mean.detach().double() * count, top1.double(), top5.double(),
                           torch.tensor(float(count), dtype=torch.float64, device=targets.device)])
        self.values = row if self.values is None else self.values + row

    def local(self) -> torch.Tensor:
        """This rank's sums so far, on the host, in SUM_FIELDS order."""
        return torch.zeros(len(SUM_FIELDS), dtype=torch.float64) if self.values is None else self.values.cpu()

    def reduced(self, allreduce_sum: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, float]:
        return summarize(allreduce_sum(self.local()))


def summarize(sums: torch.Tensor) -> dict[str, float]:
    """Global loss mean, top-1 and top-5 (percent) and the image count from summed values."""
    loss_sum, correct1, correct5, count = (float(v) for v in sums)
    if count == 0:
        return {"loss": float("nan"), "top1": float("nan"), "top5": float("nan"), "samples": 0}
    return {"loss": loss_sum / count, "top1": 100.0 * correct1 / count, "top5": 100.0 * correct5 / count,
            "samples": int(round(count))}


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


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
