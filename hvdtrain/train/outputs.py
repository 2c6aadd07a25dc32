"""The end of an epoch and of a run: rank 0's writers (metrics.jsonl, tensorboard, checkpoints, trackers),
validation with the EMA (stopped where too many validation files failed: train/bad_data.py), best.pt and
train.target, the epoch line, and the checkpointed stops.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable

from ..checkpoint import io as checkpoint
from ..comm import dist
from ..comm.dist import log
from ..config import ConfigError, dump_yaml, target_value, validates_after
from ..data.loaders import shutdown_workers
from ..fault import attempts, signals
from ..fault.preemption import StopRequest
from ..launch.job import current as current_job
from ..launch.job import resume_hint
from ..observe import tracking
from ..observe.metrics import MetricSums, MetricsWriter, StepCurves, tensorboard_folder
from ..observe.rank_logs import write_host_map
from ..observe.report import add_rank_report
from ..ownership import own_folder, write_atomic
from ..tasks import metric_direction
from .bad_data import check_validation
from .engine import evaluate
from .run import Run, best_metric_name, is_better, reaches, release, target_metric_name
from .run_folder import FIX
from .save import audit_ranks, save_checkpoint
from .stops import NoProgress, Preempted


class Outputs:
    """Rank 0's writers (metrics.jsonl, tensorboard, checkpoints, trackers); inert on other ranks."""

    def __init__(self, run: Run):
        self.writer, self.saver, self.tracker = None, None, None
        self.curves: StepCurves | None = None  # TensorBoard's step-level curves
        if dist.is_primary():
            share = run.cfg.output.share
            # Made and checked by setup() on the first rank 0; again here for an elastic run's next rank 0
            # (hvdtrain/ownership.py). No file is written through a link.
            own_folder(run.run_dir, share, what="output folder", fix=FIX)
            write_atomic(run.run_dir / "config.yaml", dump_yaml(run.cfg), share)
            if run.peers:
                write_host_map(run.run_dir, [(p.rank, p.host, p.pid) for p in run.peers], share)
            self.writer = MetricsWriter(run.run_dir, tensorboard=run.cfg.output.tensorboard, share=share,
                                        start_step=run.state.position.step,
                                        stamp=run.claim.stamp() if run.claim is not None else None,
                                        tb_dir=tensorboard_folder(run.run_dir, run.cfg.output.tensorboard_dir),
                                        tags=run.cfg.output.tensorboard_tags)
            if run.cfg.output.tensorboard:
                self.curves = StepCurves(run.cfg.tracking.every_steps, self.writer)
            if run.resume_changes:  # what changed at this resume (checkpoint.resume=force, or allowed keys)
                self.writer.write({"split": "resume", "epoch": run.state.position.epoch,
                                   "step": run.state.position.step, **run.resume_changes})
            self.saver = checkpoint.CheckpointSaver(run.run_dir / "checkpoints", keep=run.cfg.checkpoint.keep,
                                                    share=share)
            if "tracking" in run.state.extra:
                self.tracker = tracking.Tracker(run.cfg, run.run_dir, run.state.extra["tracking"],
                                                sorted({peer.host for peer in run.peers}), log,
                                                resume={"step": run.state.position.step, **run.resume_changes}
                                                if run.resume_changes else None)

    def epoch_sums(self, run: Run) -> MetricSums:
        """The sums the epoch's training accumulates into (every rank); the tracker reads rank 0's."""
        sums = MetricSums(len(run.task.sum_fields))
        for follower in (self.tracker, self.curves):
            if follower is not None:
                follower.start_epoch(run.state.position.step, sums)
        return sums

    def after_step(self, run: Run, sums: MetricSums) -> None:
        for follower in (self.tracker, self.curves):
            if follower is not None:
                follower.after_step(run.state.position.step, sums, run.task.summarize,
                                    run.state.optimizer.param_groups[0]["lr"], run.global_batch)

    def close(self) -> None:
        if self.tracker is not None:  # before the writers: it may log
            self.tracker.close(tracking.close_status())
            self.tracker = None
        if self.writer is not None:
            self.writer.close()
        if self.saver is not None:
            self.saver.close()  # the checkpoint folder's descriptor


def validate_with_ema(run: Run, val_metrics: dict[str, Any], watch: bool) -> None:
    """Score the EMA weights too (after the model's buffers were averaged over ranks) and add the
    metrics with an ``ema_`` prefix."""
    run.ema.copy_buffers(run.state.model)
    ema = evaluate(run.state, run.settings, run.loaders.val, dist.allreduce_sum,
                   on_batch=run.watchdog.beat if watch else run.watchdog.progress, model=run.ema.module)
    for key, value in ema.items():
        if key not in ("samples", "seconds", "samples_per_sec") and not key.startswith("bad_files"):
            val_metrics[f"ema_{key}"] = value


def check_target(run: Run, epoch: int, val_metrics: dict[str, Any]) -> None:
    """``train.target``: mark the epoch whose validation metric reaches the target, with the time to it
    (every rank computes the same: the metrics are global sums)."""
    if run.clock is None:
        return
    name, key = target_metric_name(run)
    if name not in val_metrics:
        raise ConfigError(f"config key '{key}': no validation metric '{name}' (this run has "
                          f"{', '.join(k for k in val_metrics if isinstance(val_metrics[k], float))})")
    target = target_value(run.cfg)
    if reaches(run.task, val_metrics[name], target, name):
        val_metrics.update(target_reached=True, target=target, target_metric=name,
                           time_to_target_seconds=run.clock.seconds(), epochs_to_target=epoch + 1)


def end_epoch(run: Run, outputs: Outputs, epoch: int, train_metrics: dict[str, Any],
              watch: bool = True) -> dict[str, Any]:
    """Average buffers, validate, checkpoint and log one finished epoch (every rank)."""
    state, task = run.state, run.task
    add_rank_report(run, train_metrics)
    dist.average_buffers(state.model)
    audit_ranks(run, f"the end of epoch {epoch + 1} (global step {state.position.step})", floating_buffers=True)
    if not validates_after(run.cfg, epoch):  # eval.every_epochs: checkpoint and log the training part only
        state.position.start_epoch(epoch + 1)

        def record_training(path: Path | None) -> None:  # with the checkpoint, before the ranks' round
            if outputs.writer is None:
                return
            record = {"split": "train", "epoch": epoch, "step": state.position.step,
                      **{k: v for k, v in train_metrics.items() if k not in ("stopped", "steps")}}
            outputs.writer.write(record)
            if outputs.tracker is not None:
                outputs.tracker.epoch(record)
                outputs.tracker.checkpoint(path, False)
            log(f"epoch {epoch + 1}/{run.cfg.train.epochs}  train loss {train_metrics['loss']:.4f} (not validated: "
                f"eval.every_epochs={run.cfg.eval.every_epochs}) | lr {train_metrics['lr']:.4g}, "
                f"{train_metrics['seconds']:.1f}s")

        # A full disk raises after the epoch's record and line are out.
        save_checkpoint(run, outputs.saver, audited=True, must=epoch + 1 >= run.cfg.train.epochs,
                        on_saved=record_training)
        return {"train": train_metrics, "val": {}, "epoch": epoch, "step": state.position.step}
    if watch:
        run.watchdog.beat()
    val_metrics = evaluate(state, run.settings, run.loaders.val, dist.allreduce_sum,
                           on_batch=run.watchdog.beat if watch else run.watchdog.progress)
    if run.ema is not None:
        validate_with_ema(run, val_metrics, watch)
    run.watchdog.disarm()
    # Validation files failed past data.max_bad_fraction: the epoch's training is checkpointed, not
    # validated, and every rank stops (exit 65) before any of these metrics is recorded.
    check_validation(run, outputs, epoch)
    val_metrics["lr"] = train_metrics["lr"]
    name = best_metric_name(run)
    if name not in val_metrics:
        raise ConfigError(f"config key 'checkpoint.best_metric': no validation metric '{name}' (this run has "
                          f"{', '.join(k for k in val_metrics if isinstance(val_metrics[k], float))})")
    check_target(run, epoch, val_metrics)
    state.position.start_epoch(epoch + 1)
    is_best = is_better(task, val_metrics[name], state.best_metric, name)
    if is_best:
        state.best_metric = val_metrics[name]
    step = state.position.step

    def record_epoch(path: Path | None) -> None:  # with the checkpoint, before the ranks' round
        if outputs.writer is None:
            return
        for split, values in (("train", train_metrics), ("val", val_metrics)):
            record = {"split": split, "epoch": epoch, "step": step,
                      **{k: v for k, v in values.items() if k not in ("stopped", "steps")}}
            outputs.writer.write(record)
            if outputs.tracker is not None:
                outputs.tracker.epoch(record)
        if outputs.tracker is not None:
            outputs.tracker.checkpoint(path, is_best)
        log(epoch_line(run, epoch, train_metrics, val_metrics))
        if val_metrics.get("target_reached"):
            log(target_line(run, val_metrics))

    # A full disk raises after the epoch's records and line are out: its results are not lost with it.
    save_checkpoint(run, outputs.saver, is_best=is_best, audited=True, must=epoch + 1 >= run.cfg.train.epochs,
                    on_saved=record_epoch)
    return {"train": train_metrics, "val": val_metrics, "epoch": epoch, "step": step}


def epoch_line(run: Run, epoch: int, train: dict, val: dict) -> str:
    unit = getattr(run.task, "unit", "samples")
    allreduce = f"allreduce wait {100 * train['phase_allreduce']:.1f}%, " if "phase_allreduce" in train else ""
    return (f"epoch {epoch + 1}/{run.cfg.train.epochs}  {run.task.epoch_summary(train, val)}  "
            f"| {train['samples_per_sec']:.1f} {unit}/s, data wait {100 * train['data_wait_fraction']:.1f}%, "
            f"{allreduce}lr {train['lr']:.4g}, {train['seconds']:.1f}s{bad_files_note(train, val)}")


def target_line(run: Run, val: dict[str, Any]) -> str:
    """The final line of a run that reached ``train.target`` (MLPerf's time to accuracy)."""
    name = val["target_metric"]
    sign = ">=" if metric_direction(run.task, name, "train.target_metric") == "max" else "<="
    return (f"hvdtrain: target reached: val {name} {val[name]:.4g} {sign} {val['target']:g} after "
            f"{val['epochs_to_target']} epoch(s), {val['time_to_target_seconds']:.1f} s of training "
            f"(time to accuracy); stopping")


def bad_files_note(train: dict, val: dict) -> str:
    bad = {split: m.get("bad_files", 0) for split, m in (("train", train), ("val", val))}
    if not any(bad.values()):
        return ""
    return f", bad files skipped: {bad['train']} train / {bad['val']} val"


def stop_for_preemption(run: Run, outputs: Outputs, stop: StopRequest, steps: int) -> None:
    position = run.state.position
    path = save_checkpoint(run, outputs.saver, must=True)
    # Rank 0 writes it; every rank's line names it (the launcher may report any rank's).
    path = dist.broadcast_object(str(path) if path is not None else None, name="hvdtrain.stop_checkpoint")
    line = (f"hvdtrain: stopped by {stop.reason()} in epoch {position.epoch + 1}/{run.cfg.train.epochs} at step "
            f"{position.step_in_epoch}/{steps} (global step {position.step}); checkpoint saved to {path}. "
            f"{resume_hint(run.run_dir)}")
    log(line)
    idle = None
    if dist.is_primary() and position.step == run.started_step:  # not a step trained in this attempt
        idle = attempts.no_progress_line(attempts.read(run.run_dir), position.step,
                                         run.loop_started - signals.STARTED,
                                         attempts.slurm_time_limit(current_job().id))
        if idle and current_job().id:  # a new job: its own folder, unless told which run it continues
            idle = f"{idle}. A{resume_hint(run.run_dir).removeprefix('A requeue of this job resumes it; a')}"
    idle = dist.broadcast_object(idle, name="hvdtrain.no_progress")
    if idle:
        log(f"hvdtrain: {idle}")
        raise NoProgress(idle)
    # the loop's ``finally`` calls finish(): outputs closed, then every rank leaves together
    raise Preempted(line.removeprefix("hvdtrain: "))


def finish(run: Run, outputs: Iterable[Outputs]) -> None:
    """The end of a training loop (static or elastic), from its ``finally``: the timeline, the
    statistics, the loader workers and the outputs are closed, and the run's watchdog and liveness
    service stopped. After a preemption stop every rank
    then waits for the others: a launcher ends every rank as soon as one exits with an error code,
    and rank 0 must have flushed its logs and sent what its tracker holds by then."""
    if run.timeline is not None:
        run.timeline.close()
    shutdown_workers(run.loaders.train, run.loaders.val)
    for out in outputs:
        out.close()
    stop = sys.exc_info()[1]
    if isinstance(stop, Preempted) or getattr(stop, "after_checkpoint", False):  # e.g. bad_data.DataVanished
        dist.barrier()
    release(run)  # the watchdog last: it still guards the barrier
