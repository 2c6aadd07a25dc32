"""Elastic training: workers may leave (failure, preemption) and join while the job runs.

Launched as ``horovodrun -np N --min-np M --max-np K --host-discovery-script SCRIPT python -m
hvdtrain elastic.enabled=true ...``. The Trainer's one loop (train/trainer.py) runs inside Horovod
Elastic's retry loop, with the ``Elastic`` membership policy below:

* every ``elastic.commit_every_steps`` steps and at each epoch end the run's state (state.RunState:
  model, optimizer, GradScaler, position, best metric, registered components) is committed to
  host memory;
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

Horovod's own ``TorchState`` is not used: its ``broadcast_optimizer_state`` initializes a
newcomer's empty state with a zero-gradient step, which applies weight decay to the newcomer's
parameters. ``ElasticState`` goes through the run state's protocol and ``dist.broadcast_state``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import socket
from pathlib import Path
from typing import Any, Callable

import torch

from ..comm import dist
from ..config import Config, ConfigError
from ..observe.metrics import MetricSums
from ..optim.build import LRSchedule
from ..ownership import PRIVATE, open_append
from .outputs import Outputs
from .resume import resume
from .run import Run, log
from .state import RunState


class SampleLog:
    """The dataset indices every rank trained on, for auditing: ``samples.jsonl``, one line per rank
    per committed step.

    Each rank holds its records back until a commit; the commit gathers them, and rank 0 appends
    them. A step is written exactly when it is committed, the share of a rank lost right after it
    included, and steps rolled back are dropped.
    """

    def __init__(self, run_dir: Path, share: str = PRIVATE):
        self.path, self.share = run_dir / "samples.jsonl", share
        self.process = f"{os.environ.get('HOROVOD_HOSTNAME') or socket.gethostname()}:{os.getpid()}"
        self.pending: list[dict[str, Any]] = []
        self.indices: list[int] = []
        self.cursor = 0

    def start(self, indices: Any) -> None:
        """This rank's indices for the rest of the epoch (the sampler's array: no list per epoch)."""
        self.indices, self.cursor = indices, 0

    def record(self, epoch: int, step: int, count: int) -> None:
        taken = self.indices[self.cursor:self.cursor + count]
        taken = taken.tolist() if hasattr(taken, "tolist") else list(taken)
        self.cursor += count
        self.pending.append({"epoch": epoch, "step": step, "rank": dist.rank(), "size": dist.size(),
                             "process": self.process, "indices": taken})

    def commit(self) -> None:
        """A collective: every rank's held-back records, written by rank 0."""
        gathered = dist.allgather_object(self.pending, name="hvdtrain.fault.elastic.samples")
        self.pending = []
        if dist.is_primary():
            with open_append(self.path, self.share) as handle:  # never through a planted link
                handle.writelines(json.dumps(entry) + "\n" for entries in gathered for entry in entries)

    def discard(self) -> None:
        self.pending = []


class ElasticState(dist.ElasticStateBase):
    """The run's state, committed in memory and synced from rank 0, with the epoch's committed
    training metric sums (summed over ranks at each commit, so that an epoch interrupted by a reset
    still reports all of its committed steps)."""

    def __init__(self, state: RunState, sum_width: int, samples: SampleLog | None = None):
        super().__init__(bcast_object=dist.broadcast_object, get_rank=dist.rank)
        self.state = state
        self.samples = samples
        self.train_sums = torch.zeros(sum_width, dtype=torch.float64)
        self.saved = self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy({"state": self.state.state_dict(), "train_sums": self.train_sums})

    def save(self) -> None:
        # The collective first: if a peer is lost during it, nothing here has changed yet.
        if self.samples is not None:
            self.samples.commit()
        self.saved = self.snapshot()

    def restore(self) -> None:
        saved = copy.deepcopy(self.saved)
        self.state.load_state_dict(saved["state"])
        self.train_sums = saved["train_sums"]
        if self.samples is not None:
            self.samples.discard()

    def check_host_updates(self) -> None:
        """Horovod's check, except that a reset always synchronizes the state.

        Horovod skips the synchronization when hosts were only removed. But the notice of a removal
        can arrive after the driver has already added a host back: the reset then starts a new
        worker, which always synchronizes, while the others skip it and go on training, and the job
        hangs with the newcomer in a broadcast and the others in an allreduce (seen in the elastic
        test, with the stack of both processes). One broadcast of the state per reset is cheap.
        """
        try:
            super().check_host_updates()
        except dist.HostsUpdatedInterrupt:
            raise dist.HostsUpdatedInterrupt(skip_sync=False) from None

    def sync(self) -> None:
        """Every rank takes the state of the rank that has trained furthest.

        Horovod broadcasts from rank 0, and ranks hosts by age, but a host that comes back from its
        blacklist cooldown can be ranked first: rank 0 is then a worker that has just joined, with
        at most the last checkpoint, and its state would roll the job back.
        """
        steps = dist.allgather_object(self.state.position.step, name="hvdtrain.fault.elastic.steps")
        root = max(range(len(steps)), key=lambda r: (steps[r], -r))
        dist.broadcast_state(self.state, root_rank=root)
        self.train_sums = dist.broadcast_object(self.train_sums, root_rank=root,
                                                name="hvdtrain.fault.elastic.train_sums")
        self.saved = self.snapshot()


def epoch_steps(cfg: Config, samples: int, global_batch: int) -> int:
    """Steps to train ``samples`` samples: the last one partial (smaller per-rank batches) when there
    is a remainder, so that none is left out. With several backward passes per step a partial step
    would leave an allreduce waiting for passes that never come: the remainder is dropped then."""
    if cfg.train.backward_passes_per_step == 1:
        return math.ceil(samples / global_batch)
    return samples // global_batch


def reconfigure(run: Run) -> int:
    """Fit the run to the current ranks; returns the full number of steps in an epoch."""
    cfg, size = run.cfg, dist.size()
    run.loaders.reshard(dist.rank(), size)
    run.global_batch = cfg.train.batch_size * size * cfg.train.backward_passes_per_step
    steps = epoch_steps(cfg, run.loaders.train_size, run.global_batch)
    if cfg.train.steps_per_epoch:
        steps = min(steps, cfg.train.steps_per_epoch)
    run.steps_per_epoch = steps
    run.settings.lr_schedule = LRSchedule.from_config(cfg.optim, run.global_batch, cfg.train.epochs, steps,
                                                      rank_batch=cfg.train.batch_size,
                                                      passes=cfg.train.backward_passes_per_step)
    log(f"hvdtrain: elastic: {size} rank(s) on {dist.cross_size()} host(s); global batch {run.global_batch}, "
        f"{steps} steps/epoch, peak lr {run.settings.lr_schedule.peak_lr:.4g}")
    return steps


class Elastic:
    """The Trainer's membership policy under Horovod Elastic (train/trainer.py has the loop): the loop runs
    in Horovod's retry loop; after every reset the run is fitted to the ranks there are; a step
    records its samples and commits every ``elastic.commit_every_steps``; an epoch commits at its
    end; the epoch's metric sums are carried across resets."""

    broadcast = False

    def check(self, cfg: Config) -> None:
        if cfg.data.synthetic:
            raise ConfigError("elastic.enabled=true needs a dataset (data.synthetic=false)")

    def start(self, run: Run) -> None:
        cfg = run.cfg
        log(f"hvdtrain: elastic: no watchdog; Horovod Elastic replaces a worker that exits, and a collective that "
            f"hangs fails after {max(30, cfg.dist.timeout_seconds)} s (Gloo's timeout, dist.timeout_seconds), which "
            f"rolls the job back to its last commit")
        resume(run, broadcast=False)
        self.cfg = cfg
        self.samples = SampleLog(run.run_dir, cfg.output.share) if cfg.elastic.sample_log else None
        self.state = ElasticState(run.state, len(run.task.sum_fields), self.samples)
        self.outputs: list[Outputs] = []
        self.committed_before = torch.zeros(0)

    def run(self, run: Run, train_epochs: Callable[[], None]) -> None:
        dist.elastic_run(lambda state: train_epochs())(self.state)

    def reconfigure(self, run: Run) -> int:
        return reconfigure(run)

    def outputs_for_this_rank(self, run: Run) -> Outputs:
        """Rank 0 writes metrics and checkpoints; after a reset rank 0 may be another process."""
        outputs = self.outputs
        if outputs and (outputs[0].writer is not None) != dist.is_primary():
            outputs.pop().close()
        if not outputs:
            outputs.append(Outputs(run))
        return outputs[0]

    def start_epoch(self, run: Run, full_steps: int) -> int:
        """The steps of this epoch for the ranks there are: the samples it has left, re-split."""
        position, loaders = run.state.position, run.loaders
        position.step_in_epoch = position.samples_in_epoch // run.global_batch
        remaining = epoch_steps(self.cfg, loaders.train_size - position.samples_in_epoch, run.global_batch)
        # The epoch's committed metric sums (global), to which this call's own (local) are added.
        self.committed_before = self.state.train_sums.clone()
        if self.samples is not None:  # this rank's share of the rest of the epoch, in order
            loaders.train_sampler.set_epoch(position.epoch, start=position.samples_in_epoch)
            self.samples.start(loaders.train_sampler.index_array())
        return min(position.step_in_epoch + remaining, full_steps)

    def epoch_sums(self, sums: MetricSums) -> torch.Tensor:
        return self.committed_before + dist.allreduce_sum(sums.local(), name="hvdtrain.fault.elastic.train_sums")

    def advance(self, run: Run) -> None:
        position, train_size = run.state.position, run.loaders.train_size
        position.samples_in_epoch += min(run.global_batch, train_size - position.samples_in_epoch)

    def after_step(self, run: Run, sums: MetricSums) -> None:
        position = run.state.position
        if self.samples is not None:
            self.samples.record(position.epoch, position.step, run.global_batch // dist.size())
        if position.step % self.cfg.elastic.commit_every_steps == 0:
            self.state.train_sums = self.epoch_sums(sums)
            self.state.commit()

    def epoch_metrics(self, run: Run, sums: MetricSums, metrics: dict[str, Any]) -> None:
        metrics.update(run.task.summarize(self.epoch_sums(sums)))  # the whole epoch, across resets
        metrics["world_size"] = dist.size()

    def end_epoch(self) -> None:
        self.state.train_sums = torch.zeros_like(self.state.train_sums)
        self.state.commit()
