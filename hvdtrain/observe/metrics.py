"""Metric accumulation as sums, reduced across ranks, and the run's metric writers.

Ranks accumulate sums (a task decides which: loss x samples, correct predictions, samples, ...)
and the job reduces the sums, never per-rank means: with uneven shards a mean of means is biased.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..ownership import PRIVATE, current_umask, file_mode, open_append, own_folder
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


def step_values(now: torch.Tensor, mark: torch.Tensor, summarize: Callable[[torch.Tensor], dict[str, Any]], lr: float,
                samples_per_sec: float) -> dict[str, float]:
    """The step-level curve point (TensorBoard's and the trackers' ``train_step/...``): the task's
    metrics of the sums accumulated between ``mark`` and ``now`` (rank 0's share of the steps since
    the last point), the learning rate of the last step and the samples/s of all ranks."""
    values = {f"train_step/{key}": value for key, value in summarize(now - mark).items()
              if key != "samples" and isinstance(value, (int, float)) and math.isfinite(value)}
    values.update({"train_step/lr": lr, "train_step/samples_per_sec": samples_per_sec})
    return values


class StepCurves:
    """Every ``every`` optimizer steps, a point of the step-level curves in TensorBoard, keyed by the
    global step: ``step_values`` of the steps since the last point (rank 0's training sums; the
    trackers send the same values, observe/tracking.py). Reading the sums waits for the device once
    per point, not per step."""

    def __init__(self, every: int, writer: "MetricsWriter"):
        self.every, self.writer = every, writer
        self.mark: tuple[int, float, torch.Tensor] | None = None  # (step, time, rank 0's sums) at the last point
        self.last_point = -1

    def start_epoch(self, step: int, sums: "MetricSums") -> None:
        self.mark = (step, time.perf_counter(), sums.local())

    def after_step(self, step: int, sums: "MetricSums", summarize: Callable, lr: float, global_batch: int) -> None:
        if not self.every or step % self.every or self.mark is None or step <= self.last_point:
            return  # (an elastic rollback trains steps again: their points are written already)
        now, local = time.perf_counter(), sums.local()
        mark_step, mark_time, mark_sums = self.mark
        speed = (step - mark_step) * global_batch / max(now - mark_time, 1e-9)
        self.writer.write_step(step, step_values(local, mark_sums, summarize, lr, speed))
        self.mark, self.last_point = (step, now, local), step


def tensorboard_folder(run_dir: Path, tensorboard_dir: str = "") -> Path:
    """Where the event files go: output.tensorboard_dir, or the run folder's tb/."""
    return Path(os.path.expanduser(tensorboard_dir)) if tensorboard_dir else run_dir / "tb"


# Horovod's examples/pytorch/pytorch_imagenet_resnet50.py: its tags (each epoch, at the 0-based epoch)
# and the value of an epoch record each one takes (accuracy a fraction, hvdtrain's top1 a percentage).
EXAMPLE_TAGS = {"loss": ("loss", 1.0), "top1": ("accuracy", 0.01)}


def restrict_event_files(folder: Path, share: str) -> None:
    """Give tensorboardX's event files in ``folder`` the mode of the run's other files (0600 in a
    private run): tensorboardX creates them with plain ``open`` (0644 within the umask), and creates
    each one in its constructor. ``folder`` is the user's own and nobody else can write it
    (own_folder), so nothing in it can have been swapped for a link."""
    mode = file_mode(share) & ~current_umask()
    uid = os.geteuid()
    for entry in os.scandir(folder):
        if entry.name.startswith("events.") and entry.is_file(follow_symlinks=False) \
                and entry.stat(follow_symlinks=False).st_uid == uid:
            os.chmod(entry.path, mode)


class MetricsWriter:
    """metrics.jsonl (one object per split per epoch), its per-rank part in metrics_ranks.jsonl
    (``by_rank``, every straggler: rank_logs.split_record; rank_logs.read_records joins them) and
    tensorboardX scalars, on rank 0 only.

    TensorBoard's x axis is the global optimizer step everywhere: the step-level curves
    (``write_step``) at their step, each epoch's record at the step of the epoch's end, so that the
    legs of a resumed run join up. A run that resumes from step ``start_step`` opens its event file
    with TensorBoard's purge mark just after it: points a crashed leg wrote past its last
    checkpoint, which this leg trains again, are hidden (tensorboardX's ``purge_step``); those up to
    the checkpoint stay. The event files go to ``tb_dir`` (output.tensorboard_dir; default ``tb/``);
    with ``tags="horovod_example"`` the epoch records become Horovod's example's four curves instead
    (``EXAMPLE_TAGS``, at the 0-based epoch, as its ``log_writer.add_scalar`` calls)."""

    def __init__(self, run_dir: Path, tensorboard: bool, share: str = PRIVATE, start_step: int = 0,
                 stamp: dict[str, Any] | None = None, tb_dir: Path | None = None, tags: str = "hvdtrain"):
        self.path = run_dir / "metrics.jsonl"
        self.stamp = dict(stamp or {})  # what every record carries: the job and attempt that wrote it
        self.ranks_path = run_dir / RANKS_FILE
        self.share, self.tags = share, tags
        self.tb = None
        self.lost: dict[str, int] = {}
        if tensorboard:
            SummaryWriter = summary_writer_class()

            # tensorboardX writes its own files: into a folder of this user's that nobody else can write
            folder = tb_dir or run_dir / "tb"
            key = "output.dir" if folder == run_dir / "tb" else "output.tensorboard_dir"
            own_folder(folder, share, what="tensorboard folder", fix=f"set {key}=/a/folder/of/yours")
            # The suffix orders the legs' files by their start even within one second (the file
            # name's time has whole seconds), which TensorBoard's reader follows.
            self.tb = SummaryWriter(logdir=str(folder), purge_step=start_step + 1 if start_step else None,
                                    filename_suffix=f".step{start_step:012d}")
            restrict_event_files(folder, share)


    def write(self, record: dict[str, Any]) -> None:
        """Append ``record``; a write that fails (a full disk, a quota, a vanished mount) costs the
        record, not the run: one warning per output, and the count at the end."""
        small, detail = split_record({**record, **self.stamp})
        for path, value in ((self.path, small), (self.ranks_path, detail)):
            if value is None:
                continue
            try:
                with open_append(path, self.share) as handle:  # never through a planted link
                    handle.write(json.dumps(value, sort_keys=False) + "\n")
            except OSError as error:
                self.failed(path.name, error)
        if self.tb is not None and record.get("split") in ("train", "val"):
            try:
                split, step = record["split"], record["step"]
                if self.tags == "horovod_example":
                    for key, (tag, scale) in EXAMPLE_TAGS.items():
                        if isinstance(record.get(key), (int, float)):
                            self.tb.add_scalar(f"{split}/{tag}", record[key] * scale, global_step=record["epoch"])
                    self.tb.flush()
                    return
                for key, value in record.items():
                    if key not in ("split", "epoch", "step", *self.stamp) and isinstance(value, (int, float)) \
                            and not isinstance(value, bool):
                        self.tb.add_scalar(f"{split}/{key}", value, global_step=step)
                if split == "train":  # which epoch ended at this step (1-based, as the epoch line says)
                    self.tb.add_scalar("epoch", record["epoch"] + 1, global_step=step)
                self.tb.flush()
            except OSError as error:
                self.failed("tensorboard", error)

    def write_step(self, step: int, values: dict[str, float]) -> None:
        """One point of the step-level curves (StepCurves); flushed with the next epoch's record or
        by tensorboardX's own timer."""
        if self.tb is None:
            return
        try:
            for key, value in values.items():
                self.tb.add_scalar(key, value, global_step=step)
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
