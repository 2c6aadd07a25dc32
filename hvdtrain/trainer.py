"""The static training loop: a fixed set of ranks from start to end (elastic.py has the other one).

    setup(cfg)                      builders: Horovod, task, loaders, model, optimizer, watchdog
    resume_and_broadcast(run)       rank 0 loads a checkpoint; broadcast_state -> every rank
    for epoch in epochs:
        sampler.set_epoch(epoch, start=samples already consumed)
        train_one_epoch                                                       (engine.py)
            for step:
                stop.agreed()?  ---- a stop signal on any rank -> stop_for_preemption:
                                     checkpoint (every rank), raise Preempted (exit 75)
                forward, loss, backward (gradients allreduced while backward runs)
                optimizer_step: synchronize, unscale, clip, step, update scale
                after_step: progress line; mid-epoch checkpoint every
                            checkpoint.every_steps; watchdog.beat(); timeline window
            metric sums allreduced (exact, once per epoch)
        end_epoch                                                             (run.py)
            add_rank_report  (observe.py) every rank's step phases and CPU/GPU use; stragglers named
            dist.average_buffers         BatchNorm statistics averaged over ranks
            evaluate                     every validation sample once, sums allreduced
            save_checkpoint              every rank's RNG and buffers gathered; rank 0 writes
            metrics.jsonl, tensorboard, the epoch line (rank 0)

A failed collective (a peer died) becomes ``LostRank``, one line naming the lost rank; a hung peer
is caught by the watchdog, which ends the process after ``dist.timeout_seconds`` without progress.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from . import dist
from .config import Config
from .engine import train_one_epoch
from .preemption import StopRequest
from .run import Outputs, Run, audit_ranks, end_epoch, finish, log, lost_rank, resume_and_broadcast, save_checkpoint, \
    setup, stop_for_preemption
from .state import RunState


def train(cfg: Config) -> tuple[Run, dict[str, Any]]:
    """Train for ``cfg.train.epochs`` epochs; returns the run and the last epoch's metrics (every rank)."""
    run = setup(cfg)
    resume_and_broadcast(run)
    state, loaders, position = run.state, run.loaders, run.state.position
    outputs = Outputs(run)
    stop = StopRequest.for_config(cfg.runtime)
    progress: Progress | None = None

    def after_step(state: RunState) -> None:
        position.samples_in_epoch = position.step_in_epoch * run.global_batch
        if progress:
            progress.update(run, position.step_in_epoch - 1)
        every = cfg.checkpoint.every_steps
        if every and position.step % every == 0 and position.step_in_epoch < run.steps_per_epoch:
            run.watchdog.disarm()
            save_checkpoint(run, outputs.saver)
        elif cfg.runtime.audit_every and position.step % cfg.runtime.audit_every == 0:
            audit_ranks(run, f"global step {position.step}")
        outputs.after_step(run, sums)
        run.watchdog.beat()  # arms the watchdog from the first completed step of the epoch on
        if run.timeline is not None:
            run.timeline.at_step(position.step)

    last: dict[str, Any] = {}
    if run.start_epoch >= cfg.train.epochs:
        log(f"hvdtrain: nothing to do: {run.start_epoch} of {cfg.train.epochs} epochs are done "
            f"(raise train.epochs to train further)")
    if run.timeline is not None:
        run.timeline.at_step(position.step)
    if run.clock is not None:
        run.clock.start()
    try:
        with stop.installed():
            for epoch in range(run.start_epoch, cfg.train.epochs):
                position.epoch = epoch
                if loaders.train_sampler is not None:
                    loaders.train_sampler.set_epoch(epoch, start=position.step_in_epoch * run.global_batch)
                progress = Progress(epoch, cfg.train.epochs, run.steps_per_epoch, first=position.step_in_epoch) \
                    if cfg.output.progress and dist.is_primary() else None
                if epoch > run.start_epoch:  # the first epoch may start slowly (workers, compilation)
                    run.watchdog.beat()
                if run.stats is not None:
                    run.stats.take_epoch()  # the epoch's statistics cover its training, not the validation before
                sums = outputs.epoch_sums(run)
                train_metrics = train_one_epoch(state, run.settings, loaders.train, run.steps_per_epoch,
                                                dist.allreduce_sum, on_step=after_step, should_stop=stop.agreed,
                                                sums=sums)
                run.watchdog.disarm()
                if progress:
                    progress.close()
                if train_metrics["stopped"]:
                    stop_for_preemption(run, outputs, stop, run.steps_per_epoch)
                last = end_epoch(run, outputs, epoch, train_metrics, watch=epoch > run.start_epoch)
                if last["val"].get("target_reached"):
                    break  # train.target_top1: every rank has the same global metrics, so all stop here
    except dist.HorovodInternalError as error:
        raise lost_rank(run, error) from None
    finally:
        finish(run, [outputs])
    return run, last


class Progress:
    """Progress through an epoch on rank 0: a tqdm bar on a terminal; on a pipe (launchers capture
    the ranks' output), a plain line every 10% of the epoch at most every 10 seconds."""

    def __init__(self, epoch: int, epochs: int, steps: int, first: int = 0):
        self.label, self.steps, self.first = f"epoch {epoch + 1}/{epochs}", steps, first
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=first, desc=self.label, unit="step", leave=False, file=sys.stderr,
                            mininterval=1.0, dynamic_ncols=True)

    def update(self, run: Run, step_in_epoch: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            return
        done = step_in_epoch + 1
        now = time.perf_counter()
        if done < self.steps and done % max(1, self.steps // 10) == 0 and now - self.last_line >= 10:
            self.last_line = now
            print(f"{self.label}: step {done}/{self.steps} ({100 * done // self.steps}%), "
                  f"{(done - self.first) / (now - self.start):.2f} steps/s, lr {run.settings.lr_at(run.state):.4g}",
                  flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
