"""The training run: wires config, Horovod, data, model, optimizer, checkpoints and logs."""

from __future__ import annotations

import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, dist
from .config import Config, dump_yaml, to_dict
from .data import DataError, DeviceNormalizer, build_loaders
from .demo_data import ensure_demo_dataset
from .engine import TrainState, evaluate, train_one_epoch
from .metrics import MetricsWriter
from .model import build_model, unwrap_state_dict
from .optim import LRSchedule, build_sgd
from .sync_bn import convert_sync_batchnorm


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


def dataset_root(cfg: Config) -> Path | None:
    if cfg.data.synthetic:
        return None
    if cfg.data.dir:
        return Path(cfg.data.dir).expanduser()
    # The built-in demo dataset: one process per host generates it while the others wait, then
    # every process finds it in place.
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
    start_epoch: int = 0


def setup(cfg: Config, resume_from: Path | None = None) -> Run:
    """Everything before the first step; identical on every rank up to the broadcast."""
    dist.init(gpu=cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and torch.cuda.is_available()))
    if not dist.is_primary():
        warnings.filterwarnings("ignore")
    device = pick_device(cfg)
    threads = threads_per_rank(cfg)
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = cfg.runtime.cudnn_benchmark
    torch.manual_seed(cfg.seed)

    world_size = dist.size()
    loaders = build_loaders(cfg, dataset_root(cfg), dist.rank(), world_size, pin_memory=device.type == "cuda")
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
    model = model.to(device, memory_format=torch.channels_last if channels_last else torch.contiguous_format)
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
                       normalize=DeviceNormalizer(device, channels_last=channels_last), device=device,
                       lr_schedule=schedule, amp_dtype=amp_dtype, label_smoothing=cfg.optim.label_smoothing,
                       clip_grad_norm=cfg.optim.clip_grad_norm, backward_passes_per_step=passes)
    run = Run(cfg=cfg, state=state, loaders=loaders, steps_per_epoch=steps_per_epoch, global_batch=global_batch,
              run_dir=Path(cfg.output.dir))
    resume_and_broadcast(run, resume_from)

    log(f"hvdtrain: {world_size} ranks on {dist.cross_size()} host(s) ({dist.controller()} controller), "
        f"device {device.type}, {threads} threads/rank")
    log(f"hvdtrain: {cfg.model.arch} with {loaders.num_classes} classes, "
        f"{'synthetic data' if cfg.data.synthetic else f'{loaders.train_size} train / {loaders.val_size} val images'}")
    log(f"hvdtrain: global batch {global_batch} = {cfg.train.batch_size}/rank x {world_size} ranks x {passes} "
        f"passes; lr {schedule.start_lr:.4g} -> {schedule.peak_lr:.4g} over {cfg.optim.warmup_epochs:g} "
        f"warm-up epochs, {cfg.optim.schedule} schedule; {steps_per_epoch} steps/epoch; "
        f"compression {compression}; amp {cfg.amp.dtype if cfg.amp.enabled else 'off'}")
    return run


def resume_and_broadcast(run: Run, path: Path | None = None) -> None:
    """Rank 0 loads the checkpoint (if any); then everything rank 0 has goes to every rank."""
    state = run.state
    progress = {"epoch": 0, "step": 0, "source": None}
    if dist.is_primary():
        path = path or checkpoint.resume_path(run.cfg.checkpoint.resume, run.run_dir)
        if path is not None:
            payload = checkpoint.load(path)
            state.model.load_state_dict(payload["model"])
            state.optimizer.load_state_dict(payload["optimizer"])
            if state.scaler is not None and payload.get("scaler"):
                state.scaler.load_state_dict(payload["scaler"])
            progress = {"epoch": int(payload["epoch"]), "step": int(payload["step"]), "source": str(path)}
    progress = dist.broadcast_object(progress, name="resume_progress")
    dist.broadcast_model(state.model)
    dist.broadcast_optimizer(state.optimizer)
    if state.scaler is not None:
        scaler_state = dist.broadcast_object(state.scaler.state_dict(), name="scaler_state")
        state.scaler.load_state_dict(scaler_state)
    state.step = progress["step"]
    run.start_epoch = progress["epoch"]
    if progress["source"]:
        log(f"hvdtrain: resumed from {progress['source']} at epoch {run.start_epoch}, step {state.step}")


def save_checkpoint(run: Run, epochs_done: int) -> Path:
    state = run.state
    payload = {
        "model": unwrap_state_dict(state.model),
        "optimizer": state.optimizer.state_dict(),
        "scaler": state.scaler.state_dict() if state.scaler is not None else {},
        "epoch": epochs_done,
        "step": state.step,
        "world_size": dist.size(),
        "config": to_dict(run.cfg),
    }
    path = run.run_dir / "checkpoints" / "last.pt"
    checkpoint.atomic_save(payload, path)
    return path


def train(cfg: Config) -> tuple[Run, dict[str, Any]]:
    """Train for ``cfg.train.epochs`` epochs; returns the run and the last epoch's metrics (every rank)."""
    run = setup(cfg)
    state, loaders = run.state, run.loaders
    writer = None
    if dist.is_primary():
        run.run_dir.mkdir(parents=True, exist_ok=True)
        (run.run_dir / "config.yaml").write_text(dump_yaml(cfg))
        writer = MetricsWriter(run.run_dir, tensorboard=cfg.output.tensorboard)
    last: dict[str, Any] = {}
    try:
        for epoch in range(run.start_epoch, cfg.train.epochs):
            if loaders.train_sampler is not None:
                loaders.train_sampler.set_epoch(epoch)
            progress = Progress(epoch, cfg.train.epochs, run.steps_per_epoch) \
                if cfg.output.progress and dist.is_primary() else None
            train_metrics = train_one_epoch(state, loaders.train, run.steps_per_epoch, dist.allreduce_sum,
                                            on_step=progress.update if progress else None)
            if progress:
                progress.close()
            dist.average_buffers(state.model)
            val_metrics = evaluate(state, loaders.val, dist.allreduce_sum)
            val_metrics["lr"] = train_metrics["lr"]
            last = {"train": train_metrics, "val": val_metrics, "epoch": epoch, "step": state.step}
            if dist.is_primary():
                for split, values in (("train", train_metrics), ("val", val_metrics)):
                    writer.write({"split": split, "epoch": epoch, "step": state.step, **values})
                save_checkpoint(run, epoch + 1)
                log(epoch_line(epoch, cfg.train.epochs, train_metrics, val_metrics))
    finally:
        if writer is not None:
            writer.close()
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
            f"lr {train_metrics['lr']:.4g}, {train_metrics['seconds']:.1f}s")
