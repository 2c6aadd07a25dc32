"""One optimizer step, one training epoch, and evaluation, for any task.

The engine knows the run's state (state.RunState), how to step (``StepSettings``) and the task
(tasks.Task), which turns batches into inputs, a loss and metric sums. Cross-rank sums come in
as an argument, and the optimizer's allreduce protocol goes through ``dist``, so the loop reads
the same at world size 1 and N.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import torch

from ..comm import dist
from ..data.files.bad_files import combine
from ..observe.metrics import MetricSums
from ..observe.phases import GPU_SAMPLE_EVERY, NO_CLOCK, StepClock
from ..optim.build import LRSchedule, set_lr
from ..tasks import Task
from .capabilities import CountsBadFiles, CountsTakenBatches, PopsBadFiles
from .guard import FiniteGuard
from .state import RunState

AllreduceSum = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class StepSettings:
    """How the run steps: fixed for a run, except the schedule (elastic runs rescale it)."""

    task: Task
    device: torch.device
    lr_schedule: LRSchedule
    dtype: torch.dtype = torch.float32         # parameters and activations (float64 for numerical checks)
    amp_dtype: torch.dtype | None = None       # None = no autocast
    clip_grad_norm: float = 0.0
    backward_passes_per_step: int = 1
    steps_in_backward: bool = False            # Horovod's Adasum: each rank steps during backward, step() combines
    phase_timing: bool = True                  # time each step's phases (observe/phases.py)
    prefetch: bool = True                      # CUDA: the next batch to the device on a side stream
    seed: int = 0                              # cfg.seed: batch-level random augmentation derives from it
    # Called with the state after every optimizer step, on every rank (e.g. the model EMA's update).
    after_optimizer_step: list[Callable[[RunState], None]] = field(default_factory=list)
    guard: FiniteGuard | None = None           # stops a run gone non-finite (None: no check)

    def current_lr(self, state: RunState) -> float:
        """The rate for the next step: a function of the position in the epoch, so that it stays
        right when a run resumes with another number of ranks (and steps per epoch)."""
        position = state.position
        return self.lr_schedule(position.epoch * self.lr_schedule.steps_per_epoch + position.step_in_epoch)

    def autocast(self) -> contextlib.AbstractContextManager:
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.amp_dtype)

    def step_clock(self) -> StepClock:
        """A clock for one epoch's phases: every step on CPU; on CUDA one step in
        ``GPU_SAMPLE_EVERY``, waiting for the device at each boundary of those steps."""
        if self.device.type == "cuda":
            device = self.device
            return StepClock(lambda: torch.cuda.synchronize(device), GPU_SAMPLE_EVERY, self.phase_timing)
        return StepClock(enabled=self.phase_timing)


def optimizer_step(state: RunState, settings: StepSettings, clock: StepClock = NO_CLOCK) -> None:
    """Wait for the gradient allreduce, then apply the averaged gradients.

    The order is the only correct one for Horovod with a GradScaler: wait for the allreduce
    (``synchronize``), unscale the averaged gradients, clip, then step without a second
    synchronization and update the scale. Every rank sees the same averaged gradients, so every
    rank takes the same decision to skip a step on inf/NaN. (Without a scaler or clipping this is
    what Horovod's own ``step()`` does, with the wait made visible to ``clock``.)
    """
    optimizer, scaler, guard = state.optimizer, state.scaler, settings.guard
    if settings.steps_in_backward:
        # Horovod's Adasum: the last backward pass stepped each rank on its own gradients and sent the
        # updates; step() combines them and applies the result, the same on every rank. No scaler and
        # no clipping here (config/checks.py refuses them); the guard looks at the combined weights.
        optimizer.step()
        clock.lap("allreduce")
        if guard is not None:
            guard.after_allreduce(state.model, state.position.step, weights=True)
        optimizer.zero_grad()
        clock.lap("optimizer")
        return
    # CPU: wait in short naps, then asleep (dist.wait_quietly). CUDA keeps Horovod's own wait, not
    # yet measured against it on a GPU.
    dist.synchronize(optimizer, quiet=settings.device.type == "cpu")
    clock.lap("allreduce")
    if scaler is not None:
        scaler.unscale_(optimizer)
    elif guard is not None:
        guard.after_allreduce(state.model, state.position.step)
    if settings.clip_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(state.model.parameters(), settings.clip_grad_norm)
    with dist.skip_synchronize(optimizer):
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        old_scale = scaler._scale.clone() if guard is not None and scaler._scale is not None else None
        scaler.update()
        if old_scale is not None:
            guard.after_scaler_update(old_scale, scaler._scale, state.position.step)
    optimizer.zero_grad()
    clock.lap("optimizer")


class Epoch:
    """One epoch's optimizer steps, from ``state.position.step_in_epoch`` up to ``steps``, which the
    caller runs one at a time and does its own work between (the engine calls nothing back)::

        epoch = Epoch(state, settings, batches, steps, allreduce_sum, sums)
        epoch.run(after_step, should_stop)   # the caller's checkpoints, progress, commits; its stops
        metrics = epoch.metrics()

    Each step consumes ``backward_passes_per_step`` batches; the caller's work between steps counts
    in the step's "other" phase. ``metrics()`` (a collective) returns global metrics over the steps
    run: the task's metrics (loss, samples, ...), seconds, samples_per_sec, lr, data_wait_fraction
    (time waiting for the next batch over the wall time, averaged over ranks), steps (the steps run),
    stopped, and ``rank_phases``: this rank's seconds per step by phase (``StepClock.summary``; not
    reduced: run.end_epoch gathers them). ``sums``, when given, is where this rank's metric sums
    accumulate (the caller may read them between steps).
    """

    def __init__(self, state: RunState, settings: StepSettings, batches: Iterable[Any], steps: int,
                 allreduce_sum: AllreduceSum, sums: MetricSums | None = None):
        self.state, self.settings, self.batches, self.steps = state, settings, batches, steps
        self.allreduce_sum = allreduce_sum
        self.sums = MetricSums(len(settings.task.sum_fields)) if sums is None else sums
        position = state.position
        self.start = time.perf_counter()
        # A loader that counts its bad files has one step's batches taken ahead, so that the ranks
        # agree on a stop for vanished data before the step that would train on it (train/bad_data.py).
        # One whose position counts the batches taken (tar shards) holds them itself: read and counted,
        # but not taken, so that a checkpoint at a stop counts only the batches trained on.
        count = (steps - position.step_in_epoch) * settings.backward_passes_per_step
        ahead = settings.backward_passes_per_step if counts_bad_files(batches) else 0
        if counts_taken_batches(batches):
            batches.hold_ahead(ahead, count)
            ahead = 0
        self.iterator = DeviceBatches(batches, settings, count=count, ahead=ahead)
        self.clock = settings.step_clock()
        self.data_seconds = time.perf_counter() - self.start  # waiting for the batches taken ahead
        self.stopped = False
        self.first_step = position.step_in_epoch
        self.lr = settings.current_lr(state)
        state.model.train()

    @property
    def remaining(self) -> int:
        return self.steps - self.state.position.step_in_epoch

    def stop(self) -> None:
        """End the epoch before its next step (a stop the ranks agreed on: every rank calls it alike)."""
        self.stopped = True

    def run(self, after_step: Callable[[], None] | None = None,
            should_stop: Callable[[bool], bool] | None = None) -> None:
        """The epoch's steps as a run takes them (the trainer's loop): ``after_step`` after every step
        (checkpoints, progress, commits); ``should_stop(first)`` at every step boundary with steps
        left, ``first`` before the first step, which must give the same answer on every rank and ends
        the epoch (``stop``). ``metrics()`` follows."""
        if should_stop is not None and self.remaining > 0 and should_stop(True):
            self.stop()
        for _ in self:
            if after_step is not None:
                after_step()
            if should_stop is not None and self.remaining > 0 and should_stop(False):
                self.stop()

    def __iter__(self) -> Iterator[None]:
        clock = self.clock
        while not self.stopped and self.remaining > 0:
            clock.begin()
            self.step()
            yield
            clock.end()

    def step(self) -> None:
        state, settings, clock = self.state, self.settings, self.clock
        task, model, position = settings.task, state.model, state.position
        passes = settings.backward_passes_per_step
        self.lr = settings.current_lr(state)
        set_lr(state.optimizer, self.lr)
        clock.lap("other")
        for pass_index in range(passes):
            fetch_start = time.perf_counter()
            inputs, targets = next(self.iterator)
            # Batch-level augmentation (mixup/cutmix): its draws depend only on the place in the run.
            inputs, targets = task.augment_batch(inputs, targets, batch_seed(settings.seed, position.epoch,
                                                                             position.step, pass_index, dist.rank()))
            self.data_seconds += time.perf_counter() - fetch_start
            clock.lap("data")
            with settings.autocast():
                outputs = model(inputs)
                loss = task.loss(outputs, targets, training=True)
            self.sums.add(task.metric_sums(loss.detach(), outputs.detach(), targets))
            scaled = loss / passes
            if state.scaler is not None:
                state.scaler.scale(scaled).backward()
            else:
                scaled.backward()
            clock.lap("compute")
        optimizer_step(state, settings, clock)
        position.step += 1
        position.step_in_epoch += 1
        if settings.guard is not None:
            settings.guard.check(position.step)  # before anything sees the new weights
        for hook in settings.after_optimizer_step:
            hook(state)

    def metrics(self) -> dict[str, Any]:
        """The epoch's global metrics (a collective: every rank calls it)."""
        settings, allreduce_sum, position = self.settings, self.allreduce_sum, self.state.position
        seconds = time.perf_counter() - self.start
        if settings.guard is not None:
            settings.guard.check()
        metrics: dict[str, Any] = settings.task.summarize(self.sums.reduced(allreduce_sum))
        wait = allreduce_sum(torch.tensor([self.data_seconds / max(seconds, 1e-9), 1.0], dtype=torch.float64))
        metrics.update(seconds=seconds, lr=self.lr, samples_per_sec=metrics["samples"] / max(seconds, 1e-9),
                       data_wait_fraction=float(wait[0] / wait[1]), steps=position.step_in_epoch - self.first_step,
                       stopped=self.stopped, rank_phases=self.clock.summary())
        add_bad_files(metrics, self.batches, allreduce_sum)
        return metrics


class DeviceBatches:
    """A loader's batches as the task's (inputs, targets) on the training device, at most ``count``.

    On CUDA (``runtime.prefetch``) the next batch goes to the device on a side stream while the
    current step computes: its host-to-device copy from pinned memory, and whatever the task does
    there (normalization, the device JPEG decoder). The step's stream waits for that stream before
    it reads the batch, and the batch's memory is marked as used by the step's stream, so the
    caching allocator does not hand it out while the step still reads it. Only ``count`` batches are
    taken from the loader, so nothing beyond the epoch's steps is read. Loaders whose checkpointed
    position counts the batches taken (tar shards) get no prefetch: the batch taken ahead would be
    counted as trained on (they hold the next step's batches themselves: data/shards/loader.py). On a CPU,
    each batch is prepared when it is asked for; ``ahead`` batches
    are taken from the loader before that (as they come, not yet on the device), so that the loader
    has counted what they hold.
    """

    def __init__(self, batches: Iterable[Any], settings: StepSettings, count: int | None = None, ahead: int = 0):
        self.iterator: Iterator = iter(batches)
        self.settings, self.remaining = settings, count
        device = settings.device
        self.stream = torch.cuda.Stream(device) if (device.type == "cuda" and settings.prefetch and
                                                    not counts_taken_batches(batches)) else None
        self.ready = self.load() if self.stream is not None else None
        self.ahead, self.taken_ahead = (ahead if self.stream is None else 0), deque()
        self.take_ahead()

    def take_ahead(self) -> None:
        while len(self.taken_ahead) < self.ahead:
            try:
                self.taken_ahead.append(self.take())
            except StopIteration:
                return

    def __iter__(self) -> "DeviceBatches":
        return self

    def take(self) -> Any:
        if self.remaining is not None:
            if self.remaining <= 0:
                raise StopIteration
            self.remaining -= 1
        return next(self.iterator)

    def load(self) -> tuple[Any, torch.Tensor] | None:
        settings = self.settings
        try:
            batch = self.take()
        except StopIteration:
            return None
        with torch.cuda.stream(self.stream):
            return settings.task.to_device(batch, settings.device, settings.dtype)

    def __next__(self) -> tuple[Any, torch.Tensor]:
        settings = self.settings
        if self.stream is None:
            batch = self.taken_ahead.popleft() if self.taken_ahead else self.take()
            self.take_ahead()
            return settings.task.to_device(batch, settings.device, settings.dtype)
        if self.ready is None:
            raise StopIteration
        current = torch.cuda.current_stream(settings.device)
        current.wait_stream(self.stream)
        inputs, targets = self.ready
        for tensor in tensors_in((inputs, targets)):
            tensor.record_stream(current)
        self.ready = self.load()
        return inputs, targets


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a batch of nested tuples, lists and dicts (a task's inputs may be any of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors_in(item)


def batch_seed(seed: int, epoch: int, step: int, pass_index: int, rank: int) -> int:
    """The random seed of one training batch on one rank: a 63-bit mix of its place in the run, so
    that a resumed run draws exactly what the uninterrupted one drew."""
    mixed = seed
    for value, multiplier in ((epoch, 0x9E3779B97F4A7C15), (step, 0xBF58476D1CE4E5B9), (pass_index, 0x94D049BB133111EB),
                              (rank, 0xD6E8FEB86659FD93)):
        mixed = ((mixed ^ (mixed >> 29)) + (value + 1) * multiplier) & (2**64 - 1)
    return mixed & (2**63 - 1)


def add_bad_files(metrics: dict, batches: Iterable, allreduce_sum: AllreduceSum) -> None:
    """The distinct files that failed in this pass over every rank, per reason (``bad_files``,
    ``bad_files_missing``, ...), for loaders that count them (capabilities.PopsBadFiles); the whole
    bad_files.Summary stays in the loader's ``last_summary`` for train/bad_data.py. Every rank has the
    same kind of loader, so every rank takes part in these collectives or none does."""
    if isinstance(batches, PopsBadFiles):
        gather = (lambda value: dist.allgather_object(value, name="hvdtrain.bad_files")) \
            if dist.initialized() and dist.size() > 1 else (lambda value: [value])
        batches.last_summary = combine(batches.pop_epoch(), allreduce_sum, gather)
        metrics.update(batches.last_summary.metrics())


@torch.no_grad()
def evaluate(state: RunState, settings: StepSettings, batches: Iterable[Any], allreduce_sum: AllreduceSum,
             on_batch: Callable[[], None] | None = None, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Exact metrics over the whole split: sums of this rank's shard, then summed over ranks.
    ``model``: another model than the state's (e.g. the EMA weights)."""
    task, model = settings.task, state.model if model is None else model
    model.eval()
    sums = MetricSums(len(task.sum_fields))
    start = time.perf_counter()
    for inputs, targets in DeviceBatches(batches, settings):
        with settings.autocast():
            outputs = task.predict(model, inputs)
        loss = task.loss(outputs, targets, training=False)
        sums.add(task.metric_sums(loss, outputs, targets))
        if on_batch is not None:
            on_batch()
    seconds = time.perf_counter() - start
    metrics: dict[str, Any] = task.summarize(sums.reduced(allreduce_sum))
    metrics.update(task.reference_metrics())
    metrics.update(seconds=seconds, samples_per_sec=metrics["samples"] / max(seconds, 1e-9))
    add_bad_files(metrics, batches, allreduce_sum)
    return metrics


def counts_bad_files(batches: Any) -> bool:
    return isinstance(batches, CountsBadFiles) and bool(batches.counts_bad_files)


def counts_taken_batches(batches: Any) -> bool:
    return isinstance(batches, CountsTakenBatches) and bool(batches.counts_taken_batches)
