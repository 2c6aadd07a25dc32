"""What the static and the elastic loop share: building a run, resuming it, writing its outputs,
finishing an epoch, checkpointing, and the two ways a run stops early (``Preempted``, ``LostRank``).

``setup`` is a row of small builders (builders.py). Neither loop is imported here: trainer.py and
elastic.py both import this module.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, dist
from .builders import (build_loaders, build_model, build_optimizer, build_peers, build_scaler, compression_for,
                       pick_device, threads_per_rank, wants_gpu)
from .config import Config, dump_yaml, step_range, to_dict
from .data.loaders import Loaders
from .dist import log
from .engine import StepSettings, evaluate
from .metrics import MetricsWriter
from .observe import TimelineWindow, add_rank_report
from .optim import LRSchedule
from .preemption import StopRequest
from .state import RunState
from .sysstats import StatsSampler
from .tasks import Task, build_task
from .watchdog import LivenessService, Peer, Watchdog, lost_message


@dataclass
class Run:
    """The pieces of a run that outlive one epoch."""

    cfg: Config
    task: Task
    state: RunState
    settings: StepSettings
    loaders: Loaders
    steps_per_epoch: int
    global_batch: int
    run_dir: Path
    watchdog: Watchdog
    peers: list[Peer] = field(default_factory=list)
    liveness: LivenessService | None = None
    start_epoch: int = 0
    timeline: TimelineWindow | None = None
    stats: StatsSampler | None = None


def setup(cfg: Config) -> Run:
    """Everything before the first step, identical on every rank (no checkpoint loaded yet)."""
    elastic = cfg.elastic.enabled
    dist.init(gpu=wants_gpu(cfg), timeout_seconds=cfg.dist.timeout_seconds, elastic=elastic,
              stall_warning_seconds=cfg.dist.stall_warning_seconds,
              stall_shutdown_seconds=cfg.dist.stall_shutdown_seconds, timeline=bool(cfg.runtime.timeline))
    liveness, peers = build_peers(elastic)
    if not dist.is_primary():
        warnings.filterwarnings("ignore")
    device = pick_device(cfg)
    threads = threads_per_rank(cfg)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.runtime.cudnn_benchmark
    torch.manual_seed(cfg.seed)

    task = build_task(cfg)
    loaders, steps_per_epoch, global_batch = build_loaders(cfg, task, device)
    dtype = getattr(torch, cfg.model.dtype)
    model = build_model(cfg, task, device, dtype)
    schedule = LRSchedule.from_config(cfg.optim, global_batch, cfg.train.epochs, steps_per_epoch)
    amp_dtype, scaler = build_scaler(cfg, device)
    state = RunState(model, build_optimizer(cfg, model, schedule, device), scaler)
    for name, component in loaders.state.items():  # e.g. the shard loader's layout of the epoch
        state.register(name, component)
    settings = StepSettings(task=task, device=device, lr_schedule=schedule, dtype=dtype, amp_dtype=amp_dtype,
                            clip_grad_norm=cfg.optim.clip_grad_norm,
                            backward_passes_per_step=cfg.train.backward_passes_per_step,
                            phase_timing=cfg.runtime.phase_timing)
    run = Run(cfg=cfg, task=task, state=state, settings=settings, loaders=loaders, steps_per_epoch=steps_per_epoch,
              global_batch=global_batch, run_dir=Path(cfg.output.dir), peers=peers, liveness=liveness,
              watchdog=Watchdog(0 if elastic else cfg.dist.timeout_seconds, peers, dist.rank()),
              timeline=TimelineWindow(cfg.runtime.timeline, step_range(cfg.runtime.timeline_steps))
              if cfg.runtime.timeline else None,
              stats=StatsSampler(cfg.runtime.stats_interval, device.index if device.type == "cuda" else None).start()
              if cfg.runtime.stats_interval > 0 else None)

    world_size, passes = dist.size(), cfg.train.backward_passes_per_step
    log(f"hvdtrain: {world_size} ranks on {dist.cross_size()} host(s) ({dist.controller()} controller), "
        f"device {device.type}, {threads} threads/rank"
        + ("; ranks: " + ", ".join(f"{p.rank}={p.host}:{p.pid}" for p in peers[:16]) if peers else "")
        + (" ..." if len(peers) > 16 else "") + ("; elastic" if elastic else ""))
    if loaders.note:
        log(f"hvdtrain: {loaders.note}")
    if run.stats is not None and device.type == "cuda" and not run.stats.has_gpu:
        log("hvdtrain: GPU statistics off: NVML is not available (pip install 'hvdtrain[gpu]' for nvidia-ml-py)")
    log(f"hvdtrain: {task.describe(loaders)}")
    log(f"hvdtrain: global batch {global_batch} = {cfg.train.batch_size}/rank x {world_size} ranks x {passes} "
        f"passes; lr {schedule.start_lr:.4g} -> {schedule.peak_lr:.4g} over {cfg.optim.warmup_epochs:g} "
        f"warm-up epochs, {cfg.optim.schedule} schedule; {steps_per_epoch} steps/epoch; "
        f"compression {compression_for(cfg, device)}; amp {cfg.amp.dtype if cfg.amp.enabled else 'off'}"
        + (f"; {cfg.model.dtype}" if cfg.model.dtype != "float32" else ""))
    return run


# --- resume ------------------------------------------------------------------------------------

def resume_and_broadcast(run: Run, path: Path | None = None) -> None:
    """Rank 0 loads the checkpoint (``path``, or what ``checkpoint.resume`` finds); then everything
    rank 0 has goes to every rank (a fresh run too: every rank starts from rank 0's initial state).

    Each rank gets back its own random generators and buffers when the number of ranks is
    unchanged. With another number of ranks the position in the epoch is carried over as a count
    of samples, so the global sample order, the epoch and the learning rate continue where they were.
    """
    found = None
    if dist.is_primary():
        found = ((path, checkpoint.load(path)) if path is not None
                 else checkpoint.load_for_resume(run.cfg.checkpoint.resume, run.run_dir / "checkpoints", log))
        if found is not None:
            run.state.load_state_dict(found[1])
    resumed = dist.broadcast_object(
        None if found is None else {"source": str(found[0]), "ranks": found[1].get("ranks", [])},
        name="hvdtrain.resumed")
    dist.broadcast_state(run.state)
    if resumed is None:
        return
    position = run.state.position
    position.step_in_epoch = position.samples_in_epoch // run.global_batch
    run.start_epoch = position.epoch
    ranks = resumed["ranks"]
    same_world = run.state.load_rank_state(ranks, dist.rank(), dist.size(),
                                           fallback_seed=run.cfg.seed + 1000003 * dist.rank() + position.step)
    log(f"hvdtrain: resumed from {resumed['source']} at {where(run)} (global step {position.step})")
    if not same_world:
        rounded = position.samples_in_epoch - position.step_in_epoch * run.global_batch
        log(f"hvdtrain: the checkpoint was written by {len(ranks)} ranks, this job has {dist.size()}: "
            f"global batch {run.global_batch}, learning rate rescaled"
            + (f"; {rounded} samples of the interrupted step are seen again" if rounded else ""))


def resume_locally(run: Run) -> None:
    """Rank 0 of an elastic job loads the checkpoint into itself; the elastic state synchronization
    then brings every rank up to date."""
    if not dist.is_primary():
        return
    found = checkpoint.load_for_resume(run.cfg.checkpoint.resume, run.run_dir / "checkpoints", log)
    if found is not None:
        run.state.load_state_dict(found[1])
        run.start_epoch = run.state.position.epoch
        log(f"hvdtrain: resumed from {found[0]} at epoch {run.start_epoch + 1} "
            f"(global step {run.state.position.step})")


def where(run: Run) -> str:
    position = run.state.position
    return f"epoch {position.epoch + 1}" + (f", step {position.step_in_epoch}/{run.steps_per_epoch}"
                                            if position.step_in_epoch else "")


# --- checkpoints and outputs -------------------------------------------------------------------

def checkpoint_payload(run: Run) -> dict[str, Any]:
    """Everything needed to continue exactly where the run is now (a collective: call on every rank)."""
    payload = run.state.state_dict()
    payload.update(
        format=checkpoint.FORMAT,
        ranks=dist.allgather_object(run.state.rank_state(), name="hvdtrain.checkpoint.ranks"),
        world_size=dist.size(),
        global_batch=run.global_batch,
        lr=run.settings.lr_at(run.state),
        task={"name": run.task.name, **run.task.checkpoint_metadata()},
        config=to_dict(run.cfg),
    )
    return payload


def save_checkpoint(run: Run, saver: checkpoint.CheckpointSaver | None, is_best: bool = False) -> Path | None:
    """Every rank takes part (random states and buffers are collected); rank 0 writes."""
    payload = checkpoint_payload(run)
    path = saver.save(payload, is_best) if saver is not None else None
    dist.barrier()  # nobody runs ahead (or exits) before the file is in place
    return path


class Outputs:
    """Rank 0's writers (metrics.jsonl, tensorboard, checkpoints); inert on other ranks."""

    def __init__(self, run: Run):
        self.writer, self.saver = None, None
        if dist.is_primary():
            run.run_dir.mkdir(parents=True, exist_ok=True)
            (run.run_dir / "config.yaml").write_text(dump_yaml(run.cfg))
            self.writer = MetricsWriter(run.run_dir, tensorboard=run.cfg.output.tensorboard)
            self.saver = checkpoint.CheckpointSaver(run.run_dir / "checkpoints", keep=run.cfg.checkpoint.keep)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


# --- the end of an epoch, and stopping early ---------------------------------------------------

def is_better(task: Task, value: float, best: float | None) -> bool:
    if best is None:
        return True
    return value > best if task.higher_is_better else value < best


def end_epoch(run: Run, outputs: Outputs, epoch: int, train_metrics: dict[str, Any],
              watch: bool = True) -> dict[str, Any]:
    """Average buffers, validate, checkpoint and log one finished epoch (every rank)."""
    state, task = run.state, run.task
    add_rank_report(run, train_metrics)
    dist.average_buffers(state.model)
    if watch:
        run.watchdog.beat()
    val_metrics = evaluate(state, run.settings, run.loaders.val, dist.allreduce_sum,
                           on_batch=run.watchdog.beat if watch else None)
    run.watchdog.disarm()
    val_metrics["lr"] = train_metrics["lr"]
    state.position.start_epoch(epoch + 1)
    is_best = is_better(task, val_metrics[task.best_metric], state.best_metric)
    if is_best:
        state.best_metric = val_metrics[task.best_metric]
    save_checkpoint(run, outputs.saver, is_best=is_best)
    step = state.position.step
    if outputs.writer is not None:
        for split, values in (("train", train_metrics), ("val", val_metrics)):
            outputs.writer.write({"split": split, "epoch": epoch, "step": step,
                                  **{k: v for k, v in values.items() if k not in ("stopped", "steps")}})
        log(epoch_line(run, epoch, train_metrics, val_metrics))
    return {"train": train_metrics, "val": val_metrics, "epoch": epoch, "step": step}


def epoch_line(run: Run, epoch: int, train: dict, val: dict) -> str:
    unit = getattr(run.task, "unit", "samples")
    allreduce = f"allreduce wait {100 * train['phase_allreduce']:.1f}%, " if "phase_allreduce" in train else ""
    return (f"epoch {epoch + 1}/{run.cfg.train.epochs}  {run.task.epoch_summary(train, val)}  "
            f"| {train['samples_per_sec']:.1f} {unit}/s, data wait {100 * train['data_wait_fraction']:.1f}%, "
            f"{allreduce}lr {train['lr']:.4g}, {train['seconds']:.1f}s{bad_files_note(train, val)}")


def bad_files_note(train: dict, val: dict) -> str:
    bad = {split: m.get("bad_files", 0) for split, m in (("train", train), ("val", val))}
    if not any(bad.values()):
        return ""
    return f", bad files skipped: {bad['train']} train / {bad['val']} val"


class Preempted(Exception):
    """Raised on every rank after a signal-triggered checkpoint; the CLI exits with EXIT_PREEMPTED."""

    exit_code = 75  # EX_TEMPFAIL: not finished, try again


class LostRank(Exception):
    """A collective failed because a peer died or hangs; ``speak`` is set on the rank that reports it."""

    def __init__(self, line: str, speak: bool):
        super().__init__(line)
        self.speak = speak


def stop_for_preemption(run: Run, outputs: Outputs, stop: StopRequest, steps: int) -> None:
    position = run.state.position
    path = save_checkpoint(run, outputs.saver)
    log(f"hvdtrain: stopped by {stop.reason()} in epoch {position.epoch + 1}/{run.cfg.train.epochs} at step "
        f"{position.step_in_epoch}/{steps} (global step {position.step}); checkpoint saved to {path}. "
        f"Resume with the same command (checkpoint.resume=auto).")
    raise Preempted()


def lost_rank(run: Run, error: Exception) -> LostRank:
    """A failed collective, as the one line that names the lost rank."""
    run.watchdog.disarm()
    first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
    first_line = re.sub(r"\[[^\]]*\]\s*", "", first_line).strip()  # drop "[file.cc:81]" prefixes
    line, speak = lost_message(run.peers, dist.rank(), f"a collective failed ({first_line[:100]})")
    return LostRank(line, speak)


def evaluate_checkpoint(cfg: Config, path: Path) -> dict[str, Any]:
    """Validation metrics of a saved model, on however many ranks this job has."""
    run = setup(cfg)
    try:
        resume_and_broadcast(run, path)
        return evaluate(run.state, run.settings, run.loaders.val, dist.allreduce_sum)
    finally:
        if run.stats is not None:
            run.stats.stop()

