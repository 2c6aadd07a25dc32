"""Elastic training: workers may leave (failure, preemption) and join while the job runs.

Launched as ``horovodrun -np N --min-np M --max-np K --host-discovery-script SCRIPT python -m
hvdtrain elastic.enabled=true ...``. The training loop runs inside Horovod Elastic's retry loop:

* every ``elastic.commit_every_steps`` steps and at each epoch end the state is committed to host
  memory: model, optimizer, GradScaler, and the position (epoch, global step, samples consumed in
  the epoch);
* when a worker fails, the others roll back to the last commit; when hosts are added or removed,
  Horovod re-forms the job; either way rank 0 then sends its committed state to every rank,
  newcomers included, and the loop continues;
* the epoch's sample order does not depend on the number of ranks, and the position in it is a
  count of samples all ranks consumed together, so the remaining samples are re-split over the new
  ranks: no sample of the interrupted epoch is lost or seen twice;
* the global batch, the steps per epoch and the learning rate follow the current number of ranks
  (linear scaling), at the same point of the schedule;
* the epoch's training loss and accuracy sums are committed too (summed over ranks at each commit),
  so an epoch interrupted by a reset still reports all of its committed steps.

Horovod's own ``TorchState`` is not used for the optimizer: its ``broadcast_optimizer_state``
initializes a newcomer's empty state with a zero-gradient step, which applies weight decay to the
newcomer's parameters.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
from pathlib import Path
from typing import Any

import torch

from . import dist
from .config import Config, ConfigError
from .data import shutdown_workers
from .engine import TrainState, train_one_epoch
from .metrics import SUM_FIELDS, MetricSums, summarize
from .optim import LRSchedule
from .preemption import StopRequest
from .trainer import Outputs, Run, end_epoch, log, setup, stop_for_preemption


class SampleLog:
    """The dataset indices every rank trained on, for auditing: ``samples.jsonl``, one line per rank
    per committed step.

    Each rank holds its records back until a commit; the commit gathers them, and rank 0 appends
    them. A step is written exactly when it is committed, the share of a rank lost right after it
    included, and steps rolled back are dropped.
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / "samples.jsonl"
        self.process = f"{os.environ.get('HOROVOD_HOSTNAME') or socket.gethostname()}:{os.getpid()}"
        self.pending: list[dict[str, Any]] = []
        self.indices: list[int] = []
        self.cursor = 0

    def start(self, indices: list[int]) -> None:
        self.indices, self.cursor = indices, 0

    def record(self, epoch: int, step: int, count: int) -> None:
        taken = self.indices[self.cursor:self.cursor + count]
        self.cursor += count
        self.pending.append({"epoch": epoch, "step": step, "rank": dist.rank(), "size": dist.size(),
                             "process": self.process, "indices": taken})

    def commit(self) -> None:
        """A collective: every rank's held-back records, written by rank 0."""
        gathered = dist.allgather_object(self.pending, name="hvdtrain.elastic.samples")
        self.pending = []
        if dist.is_primary():
            with self.path.open("a") as handle:
                handle.writelines(json.dumps(entry) + "\n" for entries in gathered for entry in entries)

    def discard(self) -> None:
        self.pending = []


class ElasticState(dist.ObjectState):
    """Model, optimizer, GradScaler and progress: committed in memory, synced from rank 0."""

    def __init__(self, run: Run, samples: SampleLog | None):
        self._run = run
        self._samples = samples
        self._saved = self._snapshot()
        state = run.state
        super().__init__(bcast_object=dist.broadcast_object, get_rank=dist.rank, epoch=state.epoch,
                         step=state.step, samples_in_epoch=state.step_in_epoch * run.global_batch,
                         best_top1=run.best_top1, train_sums=[0.0] * len(SUM_FIELDS))

    def _snapshot(self) -> dict[str, Any]:
        state = self._run.state
        return {"model": {k: v.detach().clone() for k, v in state.model.state_dict().items()},
                "optimizer": copy.deepcopy(state.optimizer.state_dict()),
                "scaler": state.scaler.state_dict() if state.scaler is not None else None}

    def save(self) -> None:
        # The collective first: if a peer is lost during it, nothing here has changed yet.
        if self._samples is not None:
            self._samples.commit()
        self._saved = self._snapshot()
        super().save()

    def restore(self) -> None:
        state = self._run.state
        state.model.load_state_dict(self._saved["model"])
        state.optimizer.load_state_dict(self._saved["optimizer"])
        if state.scaler is not None:
            state.scaler.load_state_dict(self._saved["scaler"])
        if self._samples is not None:
            self._samples.discard()
        super().restore()

    def sync(self) -> None:
        state = self._run.state
        dist.broadcast_model(state.model)
        dist.broadcast_optimizer(state.optimizer)
        if state.scaler is not None:
            state.scaler.load_state_dict(dist.broadcast_object(state.scaler.state_dict(), name="scaler_state"))
        super().sync()


def epoch_steps(cfg: Config, images: int, global_batch: int) -> int:
    """Steps to train ``images`` images: the last one partial (smaller per-rank batches) when there
    is a remainder, so that none is left out. With several backward passes per step a partial step
    would leave an allreduce waiting for passes that never come: the remainder is dropped then."""
    if cfg.train.backward_passes_per_step == 1:
        return math.ceil(images / global_batch)
    return images // global_batch


def reconfigure(run: Run) -> int:
    """Fit the run to the current ranks; returns the full number of steps in an epoch."""
    cfg, size = run.cfg, dist.size()
    run.loaders.reshard(dist.rank(), size)
    run.global_batch = cfg.train.batch_size * size * cfg.train.backward_passes_per_step
    steps = epoch_steps(cfg, run.loaders.train_size, run.global_batch)
    if cfg.train.steps_per_epoch:
        steps = min(steps, cfg.train.steps_per_epoch)
    run.steps_per_epoch = steps
    run.state.lr_schedule = LRSchedule.from_config(cfg.optim, run.global_batch, cfg.train.epochs, steps)
    log(f"hvdtrain: elastic: {size} rank(s) on {dist.cross_size()} host(s); global batch {run.global_batch}, "
        f"{steps} steps/epoch, peak lr {run.state.lr_schedule.peak_lr:.4g}")
    return steps


def outputs_for_this_rank(run: Run, outputs: list[Outputs]) -> Outputs:
    """Rank 0 writes metrics and checkpoints; after a reset rank 0 may be another process."""
    if outputs and (outputs[0].writer is not None) != dist.is_primary():
        outputs.pop().close()
    if not outputs:
        outputs.append(Outputs(run))
    return outputs[0]


def train_elastic(cfg: Config) -> tuple[Run, dict[str, Any]]:
    if cfg.data.synthetic:
        raise ConfigError("elastic.enabled=true needs a dataset (data.synthetic=false)")
    run = setup(cfg)
    samples = SampleLog(run.run_dir) if cfg.elastic.sample_log else None
    elastic_state = ElasticState(run, samples)
    stop = StopRequest()
    outputs: list[Outputs] = []
    last: dict[str, Any] = {}

    @dist.elastic_run
    def loop(es: ElasticState) -> None:
        nonlocal last
        state, loaders = run.state, run.loaders
        full_steps = reconfigure(run)
        out = outputs_for_this_rank(run, outputs)
        run.best_top1 = es.best_top1
        while es.epoch < cfg.train.epochs:
            state.epoch, state.step = es.epoch, es.step
            state.step_in_epoch = es.samples_in_epoch // run.global_batch
            remaining = epoch_steps(cfg, loaders.train_size - es.samples_in_epoch, run.global_batch)
            steps = min(state.step_in_epoch + remaining, full_steps)
            loaders.train_sampler.set_epoch(es.epoch, start=es.samples_in_epoch)
            if samples is not None:
                samples.start(loaders.train_sampler.indices())

            # Loss and accuracy sums of the epoch's committed steps (global), and this call's own (local).
            committed_before = torch.tensor(es.train_sums, dtype=torch.float64)
            sums = MetricSums()

            def epoch_sums() -> torch.Tensor:
                return committed_before + dist.allreduce_sum(sums.local(), name="hvdtrain.elastic.train_sums")

            def after_step(state: TrainState) -> None:
                consumed = min(run.global_batch, loaders.train_size - es.samples_in_epoch)
                es.samples_in_epoch += consumed
                es.step = state.step
                if samples is not None:
                    samples.record(state.epoch, state.step, run.global_batch // dist.size())
                if state.step % cfg.elastic.commit_every_steps == 0:
                    es.train_sums = epoch_sums().tolist()
                    es.commit()

            train_metrics = train_one_epoch(state, loaders.train, steps, dist.allreduce_sum, on_step=after_step,
                                            should_stop=stop.agreed, sums=sums)
            train_metrics.update(summarize(epoch_sums()))  # the whole epoch, across resets
            if train_metrics["stopped"]:
                stop_for_preemption(run, out, stop, steps)
            train_metrics["world_size"] = dist.size()
            last = end_epoch(run, out, es.epoch, train_metrics, watch=False)
            es.epoch, es.samples_in_epoch, es.step, es.best_top1 = es.epoch + 1, 0, state.step, run.best_top1
            es.train_sums = [0.0] * len(SUM_FIELDS)
            es.commit()

    try:
        with stop.installed():
            loop(elastic_state)
    finally:
        shutdown_workers(run.loaders.train, run.loaders.val)
        for out in outputs:
            out.close()
    return run, last

