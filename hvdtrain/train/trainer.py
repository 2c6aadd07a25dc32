"""The one training loop, for a fixed set of ranks and for Horovod Elastic alike.

    Trainer(cfg).fit()
      setup(cfg)                       builders: Horovod, task, loaders, model, optimizer, watchdog
      membership.start(run)            static: resume(run) -- rank 0 loads, every rank gets its state;
                                       the first epoch's order starts drawing (draw_first_epoch)
                                       elastic: rank 0 loads; the elastic state syncs the others
      membership.run(train_epochs)     static: once; elastic: in Horovod Elastic's retry loop
        train_epochs
          membership.reconfigure       elastic: batch, steps and learning rate for the ranks there are
          for each epoch:
            sampler.set_epoch(epoch, start=samples already consumed)
            for each step of engine.Epoch:                                   (train/engine.py)
                forward, loss, backward (gradients allreduced while backward runs)
                optimizer_step: synchronize, unscale, clip, step, update scale
              after_step, in this order:
                the position; the progress line
                the checkpoint policy: a mid-epoch checkpoint every checkpoint.every_steps, else
                  the cross-rank audit every runtime.audit_every
                membership.after_step          elastic: sample log, commit every commit_every_steps
                the tracker's step point; watchdog.beat(); timeline window
              a stop signal on any rank, or failed training files past data.max_bad_fraction
                (bad_data.DataGuard; counted one step ahead), agreed at the step boundary, ends the epoch
                (without a data guard, in static runs, it is sent about every 0.5 s of steps and read at
                the next such boundary: no wait and no round per step; fault/preemption.py)
            data vanished? stop_for_vanished_data: checkpoint of the last good step, raise DataVanished (65)
            stopped? stop_for_preemption: checkpoint (every rank), raise Preempted (exit 75)
              (a mid-epoch checkpoint keeps the epoch's training sums so far: Static.sums_so_far;
              the resumed epoch's record adds them, Static.epoch_metrics)
            end_epoch                                                         (train/run.py)
              add_rank_report, average_buffers, evaluate, save_checkpoint, metrics.jsonl, the line
            membership.end_epoch               elastic: commit

The engine calls nothing back: the loop runs its steps one at a time and does the run's work in
between. What differs between a static and an elastic run is the ``membership`` policy
(``Static`` here, ``elastic.Elastic``): how the run starts, how the loop is run, what a step and
an epoch commit, and how a lost rank ends the job. Every other runtime option (progress, audit,
preemption, the tracker, the timeline) works the same way in both; the two that do not are
refused in one line by the config (``checkpoint.every_steps`` in elastic runs: a commit is its
checkpoint) or said at start (no watchdog in elastic runs: a hung collective fails after Gloo's
timeout, which rolls the job back).
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable

import torch

from ..comm import dist
from ..config import Config
from ..data.sampler import ShardedSampler
from ..fault import attempts, signals
from ..fault.preemption import StopRequest
from ..observe.metrics import MetricSums, last_epoch_records
from .bad_data import BadFilesLog, DataGuard, check_epoch_end, note_epoch, stop_for_vanished_data
from .capabilities import CarriesEpochSums
from .engine import Epoch
from .outputs import Outputs, end_epoch, finish, stop_for_preemption
from .resume import resume
from .run import Run, log, release, setup
from .save import audit_ranks, save_checkpoint
from .stops import lost_rank


class Static:
    """A fixed set of ranks from start to end: one run of the loop, one set of outputs; a failed
    collective means a lost peer and ends the job in one line."""

    broadcast = True

    def check(self, cfg: Config) -> None:
        pass

    def start(self, run: Run) -> None:
        self.outputs: list[Outputs] = []
        resume(run)
        draw_first_epoch(run)

    def run(self, run: Run, train_epochs: Callable[[], None]) -> None:
        try:
            train_epochs()
        except dist.HorovodInternalError as error:
            raise lost_rank(run, error) from None

    def reconfigure(self, run: Run) -> int:
        return run.steps_per_epoch

    def outputs_for_this_rank(self, run: Run) -> Outputs:
        if not self.outputs:
            self.outputs.append(Outputs(run))
        return self.outputs[0]

    def start_epoch(self, run: Run, full_steps: int) -> int:
        """The steps of this epoch; the sample position the epoch's order starts from."""
        run.state.position.samples_in_epoch = samples_taken(run)
        return full_steps

    def advance(self, run: Run) -> None:
        run.state.position.samples_in_epoch = samples_taken(run)

    def after_step(self, run: Run, sums: MetricSums) -> None:
        pass

    def epoch_metrics(self, run: Run, sums: MetricSums, metrics: dict[str, Any]) -> None:
        """A resumed epoch's record covers the whole epoch: the sums its checkpoint carried are added
        (speed, seconds and steps stay this job's own)."""
        if self.carried(run) is not None:
            metrics.update(run.task.summarize(self.sums_so_far(run, sums)))

    def carried(self, run: Run) -> torch.Tensor | None:
        """The global sums of the epoch resumed mid-way, from its checkpoint (None in any other epoch)."""
        return run.resumed_train_sums if run.state.position.epoch == run.start_epoch else None

    def sums_so_far(self, run: Run, sums: MetricSums) -> torch.Tensor:
        """The epoch's training sums over every rank, the carried ones included (a collective)."""
        total = dist.allreduce_sum(sums.local(), name="hvdtrain.train_sums")
        carried = self.carried(run)
        return total if carried is None else total + carried

    def end_epoch(self) -> None:
        pass


def samples_taken(run: Run) -> int:
    """The samples every rank together has taken in the epoch so far, in a static run: whole global
    batches (the position the epoch's order goes on from)."""
    return run.state.position.step_in_epoch * run.global_batch


def draw_first_epoch(run: Run) -> None:
    """Start drawing the share of the epoch the run starts in, from its position, on the sampler's
    thread (``ShardedSampler.draw_ahead``): the outputs and the loader's first start then hide
    ``torch.randperm`` (1.2-1.5 s at 14.2M samples on some CPUs), and the loop's ``set_epoch``
    finds the same share drawn or under way. A static run knows its position here; an elastic
    one only once its state has synced. Only hvdtrain's sampler draws ahead: a task's own
    position-keeping stream (the tar shards' ``ShardStream``, say) is left to its ``set_epoch``."""
    sampler, position = run.loaders.train_sampler, run.state.position
    if isinstance(sampler, ShardedSampler) and position.epoch < run.cfg.train.epochs:
        sampler.draw_ahead(sampler.share_key(position.epoch, samples_taken(run)))


class Trainer:
    """Trains ``cfg.train.epochs`` epochs on the ranks of this job (see the module docstring)."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        if cfg.elastic.enabled:
            from .elastic import Elastic

            self.membership: Any = Elastic()
        else:
            self.membership = Static()
        self.last: dict[str, Any] = {}

    def fit(self) -> tuple[Run, dict[str, Any]]:
        """Returns the run and the last epoch's metrics (every rank)."""
        cfg, membership = self.cfg, self.membership
        membership.check(cfg)
        self.stop = StopRequest.for_config(cfg.runtime)
        self.stop.keep_early()  # a stop signal during setup and resume stops the run at its first step
        try:
            run = self.run = setup(cfg)
            # From now on a stop signal that is never agreed (a rank stuck where no step boundary comes)
            # still ends the rank, after dist.timeout_seconds without progress (fault/watchdog.py).
            run.watchdog.stop_pending = self.stop.pending_since
            try:
                membership.start(run)
            except BaseException:
                if run.claim is not None:
                    run.claim.abandon()  # nothing of the run written (a checkpoint refused): the folder as it was
                release(run)
                raise
        except BaseException:
            self.stop.release_early()
            raise
        self.data_guard = DataGuard.for_run(run)
        # Between steps, a stop is agreed without waiting (sent about every 0.5 s of steps, read at the
        # next such boundary: fault/preemption.py), except where a step's files must be judged before
        # it trains (the data guard) or a reset may come between two boundaries (elastic: an answer
        # in flight would not survive Horovod's re-initialization).
        self.stop_waits = self.data_guard is not None or not isinstance(membership, Static)
        self.bad_log = (BadFilesLog(run.run_dir, cfg.output.share)
                        if self.data_guard is not None and dist.is_primary() else None)
        if run.start_epoch >= cfg.train.epochs:
            self.last = finished_metrics(run, broadcast=membership.broadcast)
            log(finished_line(run, self.last))
        if run.timeline is not None:
            run.timeline.at_step(run.state.position.step)
        if run.clock is not None:
            run.clock.start()
        position = run.state.position  # attempts.jsonl: this job's start and end on the run folder
        share = cfg.output.share
        run.started_step, run.loop_started = position.step, time.time()
        hosts = [peer.host for peer in run.peers]
        attempts.record_start(run.run_dir, hosts, dist.size(), position.epoch, position.step, share,
                              run.claim.attempt if run.claim is not None else None)
        try:
            with self.stop.installed():
                membership.run(run, self.train_epochs)
        finally:
            attempts.record_end(run.run_dir, sys.exc_info()[1], position.epoch, position.step, share,
                                attempt_timing(run))
            try:
                finish(run, membership.outputs)
            finally:
                self.stop.release_early()
        return run, self.last

    def train_epochs(self) -> None:
        """The epochs from the run's position to the end (again after every elastic reset)."""
        run, cfg, membership = self.run, self.cfg, self.membership
        position, loaders = run.state.position, run.loaders
        full_steps = membership.reconfigure(run)
        out = membership.outputs_for_this_rank(run)
        while position.epoch < cfg.train.epochs:
            epoch = position.epoch
            steps = membership.start_epoch(run, full_steps)
            if loaders.train_sampler is not None:
                loaders.train_sampler.set_epoch(epoch, start=position.samples_in_epoch)
            sums = out.epoch_sums(run)
            progress = Progress(epoch, cfg.train.epochs, steps, first=position.step_in_epoch,
                                every=cfg.output.progress_every_steps, sums=sums, task=run.task) \
                if cfg.output.progress and dist.is_primary() else None
            if epoch > run.start_epoch:  # the first epoch may start slowly (workers, compilation)
                run.watchdog.beat()
            if run.stats is not None:
                run.stats.take_epoch()  # the epoch's statistics cover its training, not the validation before
            # A mid-epoch checkpoint carries them (elastic runs carry theirs in their commits).
            run.train_sums_so_far = ((lambda: membership.sums_so_far(run, sums))
                                     if isinstance(membership, CarriesEpochSums) else None)
            guard = self.data_guard
            if guard is not None:
                guard.start_epoch(steps * run.global_batch)
            steps_of = Epoch(run.state, run.settings, loaders.train, steps, dist.allreduce_sum, sums)
            steps_of.run(after_step=lambda: self.after_step(out, sums, progress),
                         should_stop=lambda first: self.stop_agreed(wait=True if first else self.stop_waits))
            # An answer still on its way is read here, so that none is in flight past the steps; a
            # stop it says is agreed again at the next boundary (the signal stays recorded).
            self.stop.settle()
            train_metrics = steps_of.metrics()
            run.watchdog.disarm()
            if progress:
                progress.close()
            membership.epoch_metrics(run, sums, train_metrics)
            if guard is not None and guard.tripped:
                stop_for_vanished_data(run, out, guard, self.bad_log, steps)
            if train_metrics["stopped"]:
                stop_for_preemption(run, out, self.stop, steps)
            self.last = end_epoch(run, out, epoch, train_metrics, watch=epoch > run.start_epoch)
            membership.end_epoch()
            note_epoch(run, self.bad_log, epoch)
            check_epoch_end(run, guard, epoch, train_metrics)
            if self.last["val"].get("target_reached"):
                break  # train.target: every rank has the same global metrics, so all stop here

    def stop_agreed(self, wait: bool = True) -> bool:
        """Every rank's answer to "stop before the next step?": a stop signal or notice on any rank,
        or the epoch's failed training files past the limit (one allreduce for both). ``wait=False``:
        the answer of the previous boundary (preemption.StopRequest.agreed)."""
        guard = self.data_guard
        if guard is None:
            stop = self.stop.agreed(wait=wait)
        else:
            signalled = self.stop.agreed(extra=guard.vector())
            stop = guard.check(self.stop.extra) or signalled
        self.stop.acted = self.stop.acted or stop  # the loop now checkpoints and leaves: no deadline for it
        return stop

    def after_step(self, out: Outputs, sums: MetricSums, progress: "Progress | None") -> None:
        run, cfg = self.run, self.cfg
        position = run.state.position
        self.membership.advance(run)
        if progress:
            progress.update(run, position.step_in_epoch - 1)
        # The checkpoint policy, in one place: a mid-epoch checkpoint (audited), else an audit alone.
        every = cfg.checkpoint.every_steps
        if every and position.step % every == 0 and position.step_in_epoch < run.steps_per_epoch:
            run.watchdog.disarm()
            save_checkpoint(run, out.saver)
        elif cfg.runtime.audit_every and position.step % cfg.runtime.audit_every == 0:
            audit_ranks(run, f"global step {position.step}")
        self.membership.after_step(run, sums)
        out.after_step(run, sums)
        run.watchdog.beat()  # arms the watchdog from the first completed step of the epoch on
        if run.timeline is not None:
            run.timeline.at_step(position.step)


def attempt_timing(run: Run) -> dict[str, float]:
    """This attempt's start-up (from the process's start to the first step) and mean seconds per
    step trained (validation and checkpoints included), for attempts.jsonl."""
    timing = {"startup_seconds": round(run.loop_started - signals.STARTED, 1)}
    steps = run.state.position.step - run.started_step
    if steps > 0:
        timing["step_seconds"] = round((time.time() - run.loop_started) / steps, 4)
    return timing


def finished_metrics(run: Run, broadcast: bool) -> dict[str, Any]:
    """The last epoch's metrics of a run that had finished, as a trained epoch returns them, from
    metrics.jsonl: rank 0 reads, and with ``broadcast`` every rank gets them; {} where it has none."""
    found = last_epoch_records(run.run_dir / "metrics.jsonl", run.start_epoch - 1) if dist.is_primary() else {}
    return dist.broadcast_object(found, name="hvdtrain.finished") if broadcast else found


def finished_line(run: Run, last: dict[str, Any]) -> str:
    """One line: the run had finished, with the validation metric that picks best.pt."""
    done = f"{run.start_epoch} of {run.cfg.train.epochs} epochs"
    val = last.get("val") or {}
    best = run.cfg.checkpoint.best_metric or run.task.best_metric
    shown = [f"val {name} {val[name]:.4g}" for name in dict.fromkeys((best, "loss"))
             if isinstance(val.get(name), float)]
    metrics = f" (epoch {last['epoch'] + 1}: {', '.join(shown)})" if shown else ""
    return (f"hvdtrain: this run had finished: {done} are done{metrics}; nothing to train "
            f"(raise train.epochs to train further, or use another output.dir)")


def train(cfg: Config) -> tuple[Run, dict[str, Any]]:
    """Train for ``cfg.train.epochs`` epochs; returns the run and the last epoch's metrics (every rank)."""
    return Trainer(cfg).fit()


class Progress:
    """Progress through an epoch on rank 0: a tqdm bar on a terminal; on a pipe (launchers capture
    the ranks' output), a plain line every ``every`` steps (``output.progress_every_steps``, as
    main.py's ``--print-freq``), else every 10% of the epoch at most every 10 seconds. Both show the
    epoch's running training loss and the task's metric on rank 0's samples (``sums``: reading them
    waits for the device, once per line)."""

    def __init__(self, epoch: int, epochs: int, steps: int, first: int = 0, every: int = 0,
                 sums: MetricSums | None = None, task: Any = None):
        self.label, self.steps, self.first, self.every = f"epoch {epoch + 1}/{epochs}", steps, first, every
        self.sums, self.task = sums, task
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=first, desc=self.label, unit="step", leave=False, file=sys.stderr,
                            mininterval=1.0, dynamic_ncols=True)

    def running(self) -> str:
        """'loss 0.4123, top1 87.5 (rank 0, this epoch)': the task's loss and best metric so far."""
        if self.sums is None or self.task is None or self.sums.values is None:
            return ""
        metrics = self.task.summarize(self.sums.local())
        shown = [f"{name} {metrics[name]:.4g}" for name in dict.fromkeys(("loss", self.task.best_metric))
                 if isinstance(metrics.get(name), (int, float))]
        return f"{', '.join(shown)} (rank 0, this epoch)" if shown else ""

    def due(self, done: int, now: float) -> bool:
        if self.every:
            return done % self.every == 0
        return done < self.steps and done % max(1, self.steps // 10) == 0 and now - self.last_line >= 10

    def update(self, run: Run, step_in_epoch: int) -> None:
        done = step_in_epoch + 1
        now = time.perf_counter()
        if self.bar is not None:
            self.bar.update(1)
            if done % (self.every or max(1, self.steps // 10)) == 0:
                self.bar.set_postfix_str(self.running(), refresh=False)
            return
        if self.due(done, now):
            self.last_line = now
            running = self.running()
            print(f"{self.label}: step {done}/{self.steps} ({100 * done // self.steps}%), "
                  f"{(done - self.first) / (now - self.start):.2f} steps/s, lr {run.settings.current_lr(run.state):.4g}"
                  + (f", {running}" if running else ""), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
