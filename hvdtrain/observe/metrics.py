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

from ..ownership import PRIVATE, open_append, own_folder
from .rank_logs import RANKS_FILE, split_record


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


def last_epoch_records(path: Path, epoch: int) -> dict[str, Any]:
    """``epoch``'s train and val records in a metrics.jsonl, in the shape a trained epoch returns
    ({"train", "val", "epoch", "step"}); {} where the file or the epoch's train record is missing.
    Lines that are not JSON objects (a write cut short) are skipped."""
    found: dict[str, dict[str, Any]] = {}
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("epoch") == epoch and record.get("split") in ("train", "val"):
            found[record["split"]] = record
    if "train" not in found:
        return {}
    plain = {split: {k: v for k, v in record.items() if k not in ("split", "epoch", "step")}
             for split, record in found.items()}
    return {"train": plain["train"], "val": plain.get("val", {}), "epoch": epoch, "step": found["train"].get("step")}


def summary_writer_class() -> type:
    """tensorboardX's SummaryWriter, imported without its cloud writers: tensorboardX imports boto3 and
    google.cloud.storage when they are installed, for s3:// and gs:// log folders, which hvdtrain never
    uses (tb/ is in the run folder); boto3 alone took 0.7-2.6 s of each run's start-up on 2 cores."""
    import sys

    blocked = [name for name in ("boto3", "google.cloud.storage") if name not in sys.modules]
    for name in blocked:
        sys.modules[name] = None  # type: ignore[assignment]  # "import boto3" raises ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        for name in blocked:
            sys.modules.pop(name, None)
    return SummaryWriter


class MetricsWriter:
    """metrics.jsonl (one object per split per epoch), its per-rank part in metrics_ranks.jsonl
    (``by_rank``, every straggler: rank_logs.split_record; rank_logs.read_records joins them) and
    tensorboardX scalars, on rank 0 only."""

    def __init__(self, run_dir: Path, tensorboard: bool, share: str = PRIVATE):
        self.path = run_dir / "metrics.jsonl"
        self.ranks_path = run_dir / RANKS_FILE
        self.share = share
        self.tb = None
        self.lost: dict[str, int] = {}
        if tensorboard:
            SummaryWriter = summary_writer_class()

            # tensorboardX writes its own files: into a folder of this user's that nobody else can write
            own_folder(run_dir / "tb", share, what="tensorboard folder", fix="set output.dir=/a/folder/of/yours")
            self.tb = SummaryWriter(logdir=str(run_dir / "tb"))

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a write that fails (a full disk, a quota, a vanished mount) costs the
        record, not the run: one warning per output, and the count at the end."""
        small, detail = split_record(record)
        for path, value in ((self.path, small), (self.ranks_path, detail)):
            if value is None:
                continue
            try:
                with open_append(path, self.share) as handle:  # never through a planted link
                    handle.write(json.dumps(value, sort_keys=False) + "\n")
            except OSError as error:
                self.failed(path.name, error)
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
