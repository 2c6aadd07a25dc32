"""The training step, one training epoch and evaluation.

Nothing here imports Horovod: the distributed optimizer and the cross-rank sum come in as
arguments, so the loop reads the same at world size 1 and N.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F

from .data import DeviceNormalizer
from .metrics import MetricSums
from .optim import LRSchedule, set_lr

AllreduceSum = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class TrainState:
    """What the loop needs, in one place; ``step`` counts optimizer steps over the whole run."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer  # a Horovod DistributedOptimizer
    scaler: torch.amp.GradScaler | None
    normalize: DeviceNormalizer
    device: torch.device
    lr_schedule: LRSchedule
    amp_dtype: torch.dtype | None = None  # None = full precision
    label_smoothing: float = 0.0
    clip_grad_norm: float = 0.0
    backward_passes_per_step: int = 1
    step: int = 0            # optimizer steps taken in the whole run
    epoch: int = 0           # the epoch in progress
    step_in_epoch: int = 0   # optimizer steps completed in that epoch

    def lr_now(self) -> float:
        """The rate for the next step: a function of the position in the epoch, so that it stays
        right when a run resumes with another number of ranks (and steps per epoch)."""
        return self.lr_schedule(self.epoch * self.lr_schedule.steps_per_epoch + self.step_in_epoch)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)


def optimizer_step(state: TrainState) -> None:
    """Apply the accumulated, allreduced gradients.

    With a GradScaler the order is the only correct one for Horovod: wait for the allreduce
    (``synchronize``), unscale the averaged gradients, clip, then step without a second
    synchronization and update the scale. Every rank sees the same averaged gradients, so every
    rank takes the same decision to skip a step on inf/NaN.
    """
    optimizer, scaler = state.optimizer, state.scaler
    if scaler is not None or state.clip_grad_norm > 0:
        optimizer.synchronize()
        if scaler is not None:
            scaler.unscale_(optimizer)
        if state.clip_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(state.model.parameters(), state.clip_grad_norm)
        with optimizer.skip_synchronize():
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:
            scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad()


def train_one_epoch(
    state: TrainState,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    allreduce_sum: AllreduceSum,
    on_step: Callable[[TrainState], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    sums: MetricSums | None = None,
) -> dict[str, float]:
    """Run the epoch's optimizer steps from ``state.step_in_epoch`` up to ``steps``.

    Each step consumes ``backward_passes_per_step`` batches. ``should_stop`` is asked at every step
    boundary (it must give the same answer on every rank) and ends the epoch early. Returns global
    metrics over the steps run: loss, top1, top5, samples, seconds, images_per_sec, lr,
    data_wait_fraction (time waiting for the next batch over the wall time, averaged over ranks)
    and stopped. ``sums``, when given, is where this rank's loss and accuracy sums accumulate (the
    caller may read them between steps).
    """
    model, device = state.model, state.device
    model.train()
    sums = MetricSums() if sums is None else sums
    passes = state.backward_passes_per_step
    iterator: Iterator = iter(batches)
    data_seconds = 0.0
    stopped = False
    start = time.perf_counter()
    lr = state.lr_now()
    while state.step_in_epoch < steps:
        if should_stop is not None and should_stop():
            stopped = True
            break
        lr = state.lr_now()
        set_lr(state.optimizer, lr)
        for _ in range(passes):
            fetch_start = time.perf_counter()
            images, targets = next(iterator)
            images = state.normalize(images)
            targets = targets.to(device, non_blocking=True)
            data_seconds += time.perf_counter() - fetch_start
            with state.autocast():
                logits = model(images)
                loss = F.cross_entropy(logits, targets, label_smoothing=state.label_smoothing)
            sums.add(loss.detach(), logits.detach(), targets)
            scaled = loss / passes
            if state.scaler is not None:
                state.scaler.scale(scaled).backward()
            else:
                scaled.backward()
        optimizer_step(state)
        state.step += 1
        state.step_in_epoch += 1
        if on_step is not None:
            on_step(state)
    seconds = time.perf_counter() - start
    metrics = sums.reduced(allreduce_sum)
    wait = allreduce_sum(torch.tensor([data_seconds / max(seconds, 1e-9), 1.0], dtype=torch.float64))
    metrics.update(seconds=seconds, lr=lr, images_per_sec=metrics["samples"] / max(seconds, 1e-9),
                   data_wait_fraction=float(wait[0] / wait[1]), stopped=stopped)
    add_bad_files(metrics, batches, allreduce_sum)
    return metrics


def add_bad_files(metrics: dict, batches: Iterable, allreduce_sum: AllreduceSum) -> None:
    """Undecodable files met this epoch, summed over ranks, for loaders that count them.

    Every rank has the same kind of loader, so every rank takes part in this sum or none does.
    """
    pop_bad_files = getattr(batches, "pop_bad_files", None)
    if pop_bad_files is not None:
        total = allreduce_sum(torch.tensor([float(pop_bad_files())], dtype=torch.float64))
        metrics["bad_files"] = int(total[0])


@torch.no_grad()
def evaluate(state: TrainState, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
             allreduce_sum: AllreduceSum, on_batch: Callable[[], None] | None = None) -> dict[str, float]:
    """Exact loss, top-1 and top-5 over the whole split: sums of this rank's shard, then summed."""
    model = state.model
    model.eval()
    sums = MetricSums()
    start = time.perf_counter()
    for images, targets in batches:
        images = state.normalize(images)
        targets = targets.to(state.device, non_blocking=True)
        with state.autocast():
            logits = model(images)
        # Half-precision logits (autocast) are scored in float32; float32 and float64 as they are.
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
        sums.add(loss, logits, targets)
        if on_batch is not None:
            on_batch()
    seconds = time.perf_counter() - start
    metrics = sums.reduced(allreduce_sum)
    metrics.update(seconds=seconds, images_per_sec=metrics["samples"] / max(seconds, 1e-9))
    add_bad_files(metrics, batches, allreduce_sum)
    return metrics
