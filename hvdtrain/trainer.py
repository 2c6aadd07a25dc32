"""The training run: wires config, Horovod, data, model, optimizer, checkpoints and logs."""

from __future__ import annotations

import os
import re
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, dist
from .config import Config, dump_yaml, to_dict
from .data import DataError, DeviceNormalizer, build_loaders, shutdown_workers
from .demo_data import ensure_demo_dataset
from .engine import TrainState, evaluate, train_one_epoch
from .metrics import MetricsWriter
from .model import build_model, unwrap_state_dict
from .optim import LRSchedule, build_sgd
from .preemption import StopRequest
from .sync_bn import convert_sync_batchnorm
from .watchdog import LivenessService, Peer, Watchdog, lost_message


def log(message: str) -> None:
    """Rank 0 talks; other ranks only report errors."""
    if dist.is_primary():
        print(message, flush=True)


def pick_device(cfg: Config) -> torch.device:
    want = cfg.runtime.device
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise DataError("runtime.device=cuda but no CUDA device is visible (use runtime.device=cpu)")
        index = dist.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def threads_per_rank(cfg: Config) -> int:
    if cfg.runtime.threads > 0:
        return cfg.runtime.threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // max(1, dist.local_size()))


def dataset_root(cfg: Config, collective: bool = True) -> Path | None:
    if cfg.data.synthetic:
        return None
    if cfg.data.dir:
        return Path(cfg.data.dir).expanduser()
    # The built-in demo dataset: one process per host generates it while the others wait, then
    # every process finds it in place. (Without collectives, every process makes sure of it: the
    # generation ends in an atomic rename, so racing processes are safe.)
    if collective:
        if dist.local_rank() == 0:
            ensure_demo_dataset()
        dist.barrier()
    return ensure_demo_dataset()


@dataclass
class Run:
    """The pieces of a run that outlive one epoch."""

    cfg: Config
    state: TrainState
    loaders: Any
    steps_per_epoch: int
    global_batch: int
    run_dir: Path
    peers: list[Peer]
    liveness: LivenessService
    watchdog: Watchdog
    start_epoch: int = 0
    best_top1: float | None = None


def setup(cfg: Config, resume_from: Path | None = None) -> Run:
    """Everything before the first step; identical on every rank up to the broadcast.

    Under Horovod Elastic a worker may join a running job, whose other ranks are then inside the
    state synchronization: setup must not call any collective, and the elastic state (not
    ``resume_and_broadcast``) brings the newcomer up to date.
    """
    elastic = cfg.elastic.enabled
    dist.init(gpu=cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and torch.cuda.is_available()),
              timeout_seconds=cfg.dist.timeout_seconds, elastic=elastic)
    # Every rank's address and liveness port, known to every rank, to name a lost one later.
    # (Elastic runs leave lost workers to Horovod Elastic instead.)
    liveness = LivenessService(dist.rank())
    peers = [] if elastic else [Peer(**info) for info in dist.allgather_object(liveness.describe(),
                                                                              name="hvdtrain.peers")]
    if not dist.is_primary():
        warnings.filterwarnings("ignore")
    device = pick_device(cfg)
    threads = threads_per_rank(cfg)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.runtime.cudnn_benchmark
    torch.manual_seed(cfg.seed)

    world_size = dist.size()
    loaders = build_loaders(cfg, dataset_root(cfg, collective=not elastic), dist.rank(), world_size,
                            pin_memory=device.type == "cuda", broadcast_object=None if elastic else dist.broadcast_object)
    passes = cfg.train.backward_passes_per_step
    steps_per_epoch = len(loaders.train) // passes
    if cfg.train.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.train.steps_per_epoch)
    if steps_per_epoch == 0:
        raise DataError(f"the training split has {loaders.train_size} images: too few for one step of "
                        f"{world_size} ranks x {cfg.train.batch_size} images x {passes} passes "
                        f"(lower train.batch_size or use fewer ranks)")
    global_batch = cfg.train.batch_size * world_size * passes

    model = build_model(cfg.model, loaders.num_classes)
    if cfg.model.sync_bn:
        model = convert_sync_batchnorm(model, cuda=device.type == "cuda")
    channels_last = device.type == "cuda"
    dtype = getattr(torch, cfg.model.dtype)
    model = model.to(device, dtype=dtype,
                     memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    if cfg.runtime.compile:
        # Module.compile() compiles forward in place: parameter names and state-dict keys stay
        # unprefixed, so the optimizer, broadcasts and checkpoints are unchanged.
        model.compile()

    schedule = LRSchedule.from_config(cfg.optim, global_batch, cfg.train.epochs, steps_per_epoch)
    compression = cfg.dist.compression
    if compression == "auto":
        compression = "fp16" if device.type == "cuda" else "none"
    optimizer = dist.distributed_optimizer(
        build_sgd(model, cfg.optim, schedule(0)), model.named_parameters(), compression=compression,
        backward_passes_per_step=passes, op=cfg.dist.op)

    amp_dtype = None
    scaler = None
    if cfg.amp.enabled:
        amp_dtype = torch.float16 if cfg.amp.dtype == "float16" else torch.bfloat16
        if amp_dtype == torch.float16:
            scaler = torch.amp.GradScaler(device.type)
    state = TrainState(model=model, optimizer=optimizer, scaler=scaler,
                       normalize=DeviceNormalizer(device, channels_last=channels_last, dtype=dtype), device=device,
                       lr_schedule=schedule, amp_dtype=amp_dtype, label_smoothing=cfg.optim.label_smoothing,
                       clip_grad_norm=cfg.optim.clip_grad_norm, backward_passes_per_step=passes)
    run = Run(cfg=cfg, state=state, loaders=loaders, steps_per_epoch=steps_per_epoch, global_batch=global_batch,
              run_dir=Path(cfg.output.dir), peers=peers, liveness=liveness,
              watchdog=Watchdog(0 if elastic else cfg.dist.timeout_seconds, peers, dist.rank()))
    if elastic:
        if dist.is_primary():
            found = checkpoint.load_for_resume(cfg.checkpoint.resume, run.run_dir / "checkpoints", log)
            if found is not None:
                apply_checkpoint(run, found[1], source=found[0])
    else:
        resume_and_broadcast(run, resume_from)

    log(f"hvdtrain: {world_size} ranks on {dist.cross_size()} host(s) ({dist.controller()} controller), "
        f"device {device.type}, {threads} threads/rank"
        + ("; ranks: " + ", ".join(f"{p.rank}={p.host}:{p.pid}" for p in peers[:16]) if peers else "")
        + (" ..." if len(peers) > 16 else "") + ("; elastic" if elastic else ""))
    if loaders.index is not None:
        log(f"hvdtrain: file index of {loaders.index.root} from {loaders.index.source} "
            f"in {loaders.index.seconds:.2f}s")
    log(f"hvdtrain: {cfg.model.arch} with {loaders.num_classes} classes, "
        f"{'synthetic data' if cfg.data.synthetic else f'{loaders.train_size} train / {loaders.val_size} val images'}")
    log(f"hvdtrain: global batch {global_batch} = {cfg.train.batch_size}/rank x {world_size} ranks x {passes} "
        f"passes; lr {schedule.start_lr:.4g} -> {schedule.peak_lr:.4g} over {cfg.optim.warmup_epochs:g} "
        f"warm-up epochs, {cfg.optim.schedule} schedule; {steps_per_epoch} steps/epoch; "
        f"compression {compression}; amp {cfg.amp.dtype if cfg.amp.enabled else 'off'}")
    return run


def resume_and_broadcast(run: Run, path: Path | None = None) -> None:
    """Rank 0 loads the checkpoint (if any); then everything rank 0 has goes to every rank.

    Each rank gets back its own random generators when the number of ranks is unchanged. With a
    different number of ranks the position in the epoch is carried over as a count of samples, so
    the global sample order, the epoch and the learning rate continue where they were.
    """
    state, cfg = run.state, run.cfg
    progress: dict[str, Any] = {"source": None}
    if dist.is_primary():
        found = ((path, checkpoint.load(path)) if path is not None
                 else checkpoint.load_for_resume(cfg.checkpoint.resume, run.run_dir / "checkpoints", log))
        if found is not None:
            path, payload = found
            load_states(state, payload)
            progress = {"source": str(path), "epoch": int(payload["epoch"]), "step": int(payload["step"]),
                        "samples_in_epoch": int(payload.get("samples_in_epoch", 0)),
                        "world_size": int(payload.get("world_size", 0)), "rng": payload.get("rng", []),
                        "rank_buffers": payload.get("rank_buffers"),
                        "best_top1": payload.get("best_top1")}
    progress = dist.broadcast_object(progress, name="resume_progress")
    dist.broadcast_model(state.model)
    dist.broadcast_optimizer(state.optimizer)
    if state.scaler is not None:
        state.scaler.load_state_dict(dist.broadcast_object(state.scaler.state_dict(), name="scaler_state"))
    if not progress["source"]:
        return
    state.step = progress["step"]
    state.epoch = run.start_epoch = progress["epoch"]
    samples_per_step = run.global_batch
    state.step_in_epoch = progress["samples_in_epoch"] // samples_per_step
    run.best_top1 = progress["best_top1"]
    same_world = progress["world_size"] == dist.size()
    if progress["rank_buffers"]:
        restore_rank_buffers(state.model, progress["rank_buffers"], dist.rank() if same_world else None)
    if same_world and len(progress["rng"]) == dist.size():
        checkpoint.set_rng_state(progress["rng"][dist.rank()])
    else:
        torch.manual_seed(cfg.seed + 1000003 * dist.rank() + state.step)
    where = f"epoch {state.epoch + 1}" + (f", step {state.step_in_epoch}/{run.steps_per_epoch}"
                                          if state.step_in_epoch else "")
    log(f"hvdtrain: resumed from {progress['source']} at {where} (global step {state.step})")
    if not same_world:
        rounded = progress["samples_in_epoch"] - state.step_in_epoch * samples_per_step
        log(f"hvdtrain: the checkpoint was written by {progress['world_size']} ranks, this job has {dist.size()}: "
            f"global batch {samples_per_step}, learning rate rescaled"
            + (f"; {rounded} samples of the interrupted step are seen again" if rounded else ""))


def load_states(state: TrainState, payload: dict[str, Any]) -> None:
    """Model, optimizer and GradScaler from a checkpoint, into this process."""
    state.model.load_state_dict(payload["model"])
    state.optimizer.load_state_dict(payload["optimizer"])
    if state.scaler is not None and payload.get("scaler"):
        state.scaler.load_state_dict(payload["scaler"])


def apply_checkpoint(run: Run, payload: dict[str, Any], source: Path) -> None:
    """Load a checkpoint into this process only (elastic runs; the elastic state syncs the rest)."""
    state = run.state
    load_states(state, payload)
    state.step = int(payload["step"])
    state.epoch = run.start_epoch = int(payload["epoch"])
    state.step_in_epoch = int(payload.get("samples_in_epoch", 0)) // run.global_batch
    run.best_top1 = payload.get("best_top1")
    log(f"hvdtrain: resumed from {source} at epoch {state.epoch + 1} (global step {state.step})")


def restore_rank_buffers(model: torch.nn.Module, rank_buffers: list[dict], rank: int | None) -> None:
    """This rank's own saved buffers, or (another number of ranks) their average."""
    named = dict(model.named_buffers())
    with torch.no_grad():
        for name in rank_buffers[0]:
            if rank is not None:
                value = rank_buffers[rank][name]
            else:
                value = torch.stack([buffers[name] for buffers in rank_buffers]).mean(0)
            named[name].copy_(value)


def checkpoint_payload(run: Run) -> dict[str, Any]:
    """Everything needed to continue exactly where the run is now (a collective: call on every rank)."""
    state = run.state
    rng = dist.allgather_object(checkpoint.rng_state(), name="checkpoint_rng")
    # Mid-epoch, without SyncBN, each rank's BatchNorm statistics are its own (they are averaged at
    # epoch ends only): keep all of them, so a resumed run continues each rank's exactly.
    rank_buffers = None
    if state.step_in_epoch and dist.size() > 1:
        own = {name: b.detach().cpu() for name, b in state.model.named_buffers() if b.is_floating_point()}
        rank_buffers = dist.allgather_object(own, name="checkpoint_buffers")
    return {
        "format": 2,
        "model": unwrap_state_dict(state.model),
        "optimizer": state.optimizer.state_dict(),
        "scaler": state.scaler.state_dict() if state.scaler is not None else {},
        "epoch": state.epoch,
        "step_in_epoch": state.step_in_epoch,
        "samples_in_epoch": state.step_in_epoch * run.global_batch,
        "step": state.step,
        "lr": state.lr_now(),
        "world_size": dist.size(),
        "global_batch": run.global_batch,
        "best_top1": run.best_top1,
        "rng": rng,
        "rank_buffers": rank_buffers,
        "config": to_dict(run.cfg),
    }


def save_checkpoint(run: Run, saver: checkpoint.CheckpointSaver | None, is_best: bool = False) -> Path | None:
    """Every rank takes part (buffers and random states are collected); rank 0 writes."""
    payload = checkpoint_payload(run)
    path = saver.save(payload, is_best) if saver is not None else None
    dist.barrier()  # nobody runs ahead (or exits) before the file is in place
    return path


class LostRank(Exception):
    """A collective failed because a peer died or hangs; ``speak`` is set on the rank that reports it."""

    def __init__(self, line: str, speak: bool):
        super().__init__(line)
        self.speak = speak


class Preempted(Exception):
    """Raised on every rank after a signal-triggered checkpoint; the CLI exits with EXIT_PREEMPTED."""

    exit_code = 75  # EX_TEMPFAIL: not finished, try again


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


def end_epoch(run: Run, outputs: Outputs, epoch: int, train_metrics: dict[str, Any],
              watch: bool = True) -> dict[str, Any]:
    """Average BatchNorm statistics, validate, checkpoint and log one finished epoch (every rank)."""
    state, cfg = run.state, run.cfg
    dist.average_buffers(state.model)
    if watch:
        run.watchdog.beat()
    val_metrics = evaluate(state, run.loaders.val, dist.allreduce_sum,
                           on_batch=run.watchdog.beat if watch else None)
    run.watchdog.disarm()
    val_metrics["lr"] = train_metrics["lr"]
    state.epoch, state.step_in_epoch = epoch + 1, 0
    is_best = run.best_top1 is None or val_metrics["top1"] > run.best_top1
    if is_best:
        run.best_top1 = val_metrics["top1"]
    save_checkpoint(run, outputs.saver, is_best=is_best)
    if outputs.writer is not None:
        for split, values in (("train", train_metrics), ("val", val_metrics)):
            outputs.writer.write({"split": split, "epoch": epoch, "step": state.step,
                                  **{k: v for k, v in values.items() if k != "stopped"}})
        log(epoch_line(epoch, cfg.train.epochs, train_metrics, val_metrics))
    return {"train": train_metrics, "val": val_metrics, "epoch": epoch, "step": state.step}


def stop_for_preemption(run: Run, outputs: Outputs, stop: StopRequest, steps: int) -> None:
    state = run.state
    path = save_checkpoint(run, outputs.saver)
    log(f"hvdtrain: stopped by {stop.reason()} in epoch {state.epoch + 1}/{run.cfg.train.epochs} at step "
        f"{state.step_in_epoch}/{steps} (global step {state.step}); checkpoint saved to {path}. "
        f"Resume with the same command (checkpoint.resume=auto).")
    raise Preempted()


def train(cfg: Config) -> tuple[Run, dict[str, Any]]:
    """Train for ``cfg.train.epochs`` epochs; returns the run and the last epoch's metrics (every rank)."""
    if cfg.elastic.enabled:
        from .elastic import train_elastic

        return train_elastic(cfg)
    run = setup(cfg)
    state, loaders = run.state, run.loaders
    outputs = Outputs(run)
    stop = StopRequest()
    progress: Progress | None = None

    def after_step(state: TrainState) -> None:
        if progress:
            progress.update(state, state.step_in_epoch - 1)
        every = cfg.checkpoint.every_steps
        if every and state.step % every == 0 and state.step_in_epoch < run.steps_per_epoch:
            run.watchdog.disarm()
            save_checkpoint(run, outputs.saver)
        run.watchdog.beat()  # arms the watchdog from the first completed step of the epoch on

    last: dict[str, Any] = {}
    if run.start_epoch >= cfg.train.epochs:
        log(f"hvdtrain: nothing to do: {run.start_epoch} of {cfg.train.epochs} epochs are done "
            f"(raise train.epochs to train further)")
    try:
        with stop.installed():
            for epoch in range(run.start_epoch, cfg.train.epochs):
                state.epoch = epoch
                if loaders.train_sampler is not None:
                    loaders.train_sampler.set_epoch(epoch, start=state.step_in_epoch * run.global_batch)
                progress = Progress(epoch, cfg.train.epochs, run.steps_per_epoch) \
                    if cfg.output.progress and dist.is_primary() else None
                if epoch > run.start_epoch:  # the first epoch may start slowly (workers, compilation)
                    run.watchdog.beat()
                train_metrics = train_one_epoch(state, loaders.train, run.steps_per_epoch, dist.allreduce_sum,
                                                on_step=after_step, should_stop=stop.agreed)
                run.watchdog.disarm()
                if progress:
                    progress.close()
                if train_metrics["stopped"]:
                    stop_for_preemption(run, outputs, stop, run.steps_per_epoch)
                last = end_epoch(run, outputs, epoch, train_metrics, watch=epoch > run.start_epoch)
    except dist.HorovodInternalError as error:
        run.watchdog.disarm()
        first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
        first_line = re.sub(r"\[[^\]]*\]\s*", "", first_line).strip()  # drop "[file.cc:81]" prefixes
        line, speak = lost_message(run.peers, dist.rank(), f"a collective failed ({first_line[:100]})")
        raise LostRank(line, speak) from None
    finally:
        shutdown_workers(loaders.train, loaders.val)
        outputs.close()
    return run, last


def evaluate_checkpoint(cfg: Config, path: Path) -> dict[str, float]:
    """Validation metrics of a saved model, on however many ranks this job has."""
    run = setup(cfg, resume_from=path)
    return evaluate(run.state, run.loaders.val, dist.allreduce_sum)


class Progress:
    """Progress through an epoch on rank 0: a tqdm bar on a terminal; on a pipe (launchers capture
    the ranks' output), a plain line every 10% of the epoch at most every 10 seconds."""

    def __init__(self, epoch: int, epochs: int, steps: int):
        self.label, self.steps = f"epoch {epoch + 1}/{epochs}", steps
        self.start = self.last_line = time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc=self.label, unit="step", leave=False, file=sys.stderr,
                            mininterval=1.0, dynamic_ncols=True)

    def update(self, state: TrainState, step_in_epoch: int) -> None:
        if self.bar is not None:
            self.bar.update(1)
            return
        done = step_in_epoch + 1
        now = time.perf_counter()
        if done < self.steps and done % max(1, self.steps // 10) == 0 and now - self.last_line >= 10:
            self.last_line = now
            print(f"{self.label}: step {done}/{self.steps} ({100 * done // self.steps}%), "
                  f"{done / (now - self.start):.2f} steps/s, lr {state.lr_schedule(state.step):.4g}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def epoch_line(epoch: int, epochs: int, train_metrics: dict, val_metrics: dict) -> str:
    return (f"epoch {epoch + 1}/{epochs}  train loss {train_metrics['loss']:.4f} top1 {train_metrics['top1']:.2f}%  "
            f"| val loss {val_metrics['loss']:.4f} top1 {val_metrics['top1']:.2f}% top5 {val_metrics['top5']:.2f}%  "
            f"| {train_metrics['images_per_sec']:.1f} img/s, data wait {100 * train_metrics['data_wait_fraction']:.1f}%, "
            f"lr {train_metrics['lr']:.4g}, {train_metrics['seconds']:.1f}s{bad_files_note(train_metrics, val_metrics)}")


def bad_files_note(train_metrics: dict, val_metrics: dict) -> str:
    bad = {split: m.get("bad_files", 0) for split, m in (("train", train_metrics), ("val", val_metrics))}
    if not any(bad.values()):
        return ""
    return f", bad files skipped: {bad['train']} train / {bad['val']} val"
