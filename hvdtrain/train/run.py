"""What the static and the elastic loop share: building a run, resuming it, writing its outputs,
finishing an epoch, checkpointing, and the two ways a run stops early (``Preempted``, ``LostRank``).

``setup`` is a row of small builders (train/builders.py). Neither loop is imported here: train/trainer.py and
train/elastic.py both import this module.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..comm import dist
from ..comm.dist import log
from ..config import Config, ConfigError, step_range, target_value
from ..data.loaders import Loaders
from ..fault.liveness import LivenessService, Peer
from ..fault.watchdog import Watchdog
from ..launch import host_malloc
from ..launch.placement import place
from ..observe import tracking
from ..observe.rank_logs import WarningTally, host_map
from ..observe.report import TimelineWindow
from ..observe.sysstats import StatsSampler
from ..optim.build import LRSchedule
from ..optim.ema import ModelEma
from ..tasks import Task, build_task, metric_direction
from .builders import (
    auto_workers,
    build_loaders,
    build_model,
    build_optimizer,
    build_peers,
    build_scaler,
    compression_for,
    last_batch_note,
    lr_batch,
    pick_device,
    threads_per_rank,
    wants_gpu,
)
from .engine import StepSettings
from .guard import FiniteGuard
from .preflight import adasum_problem
from .run_folder import Claim, prepare_output_dir, sharing_note
from .state import RunState


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
    ema: ModelEma | None = None
    clock: "TrainClock | None" = None
    resume_changes: dict[str, Any] | None = None  # settings changed since the checkpoint resumed from
    warnings: WarningTally | None = None  # this rank's warnings, said once across ranks (rank_logs)
    started_step: int = 0  # the global step this attempt started training from
    loop_started: float = 0.0  # time.time() when the training loop started (after setup and resume)
    # The training sums of the epoch in progress, all ranks together, so far (a collective; set by the loop),
    # and those a mid-epoch checkpoint carried: a resumed epoch's record then covers the whole epoch.
    train_sums_so_far: Callable[[], torch.Tensor] | None = None
    resumed_train_sums: torch.Tensor | None = None
    evaluating: bool = False  # built to evaluate a checkpoint (hvdtrain evaluate): its lines say so
    claim: Claim | None = None  # rank 0's hold on run_dir (run_folder.py): the owner job, the lock, the attempt


def setup(cfg: Config, writes: bool = True, evaluating: bool = False, claim_folder: bool = True) -> Run:
    """Everything before the first step, identical on every rank (no checkpoint loaded yet).
    ``writes=False`` (evaluation): the output folder is neither made nor checked, since nothing is
    written there (a checkpoint's recorded ``output.dir`` may name any folder). ``evaluating``: for
    ``evaluate_checkpoint``, whose lines speak of the evaluation, not of a training (no batch, rate
    or recipe line). ``claim_folder``: a training run takes its folder for its job
    (run_folder.claim_folder); the benchmark writes beside nothing of a run's, and takes nothing."""
    elastic = cfg.elastic.enabled
    tracking.require_packages(cfg)
    dist.init(gpu=wants_gpu(cfg), timeout_seconds=cfg.dist.timeout_seconds, elastic=elastic,
              stall_warning_seconds=cfg.dist.stall_warning_seconds,
              stall_shutdown_seconds=cfg.dist.stall_shutdown_seconds, timeline=bool(cfg.runtime.timeline),
              engine=cfg.dist.engine)
    if cfg.dist.op == "adasum":
        problem = adasum_problem(dist.controller(), dist.built(), dist.size(), dist.cross_size(), wants_gpu(cfg))
        if problem:
            raise ConfigError(problem)
    # What a setup that fails half-way has started is stopped again: a process may start another run.
    with contextlib.ExitStack() as undo:
        liveness, peers = build_peers(elastic)
        undo.callback(liveness.close)
        claim = None
        # output.tensorboard_dir, checked with the run folder (its default, tb/, is in it)
        own_tensorboard = Path(os.path.expanduser(cfg.output.tensorboard_dir)) \
            if cfg.output.tensorboard and cfg.output.tensorboard_dir else None
        if writes:
            problem, claim = prepare_output_dir(Path(cfg.output.dir), dist.is_primary(), None if elastic else
                                                lambda found: dist.broadcast_object(found, name="hvdtrain.output_dir"),
                                                share=cfg.output.share, resume=cfg.checkpoint.resume,
                                                claim=claim_folder, tensorboard=own_tensorboard)
            if problem:
                raise ConfigError(problem)
            if claim is not None:
                undo.callback(claim.abandon)  # nothing of the run written yet: the folder as it was
            log(f"hvdtrain: output folder {Path(cfg.output.dir).absolute()}"
                + sharing_note(Path(cfg.output.dir), cfg.output.share)
                + (f"; TensorBoard in {own_tensorboard.absolute()}" if own_tensorboard else "")
                + (f" ({claim.job.label()}, attempt {claim.attempt} on this folder)"
                   if claim is not None and claim.job.id else ""))
            for note in claim.notes if claim is not None else ():
                log(note)
        # Other ranks print no warning; each is counted and rank 0 says it once with its count.
        tally = WarningTally(speak=dist.is_primary()).install()
        undo.callback(tally.uninstall)
        device = pick_device(cfg)
        placement = place(cfg.runtime.cpu_affinity, device.type, elastic)
        own_cores = placement.cores
        threads, threads_from = threads_per_rank(cfg, own_cores, placement.launcher_bound)
        if cfg.data.workers < 0:
            cfg.data.workers, workers_note = auto_workers(own_cores, os.environ, len(os.sched_getaffinity(0)),
                                                          dist.local_size())
            log(f"hvdtrain: {workers_note}")
        torch.set_num_threads(threads)
        malloc = host_malloc.apply(cfg.runtime.host_malloc, device.type)
        if device.type == "cuda":
            torch.backends.cudnn.benchmark = cfg.runtime.cudnn_benchmark
        torch.manual_seed(cfg.seed)

        task = build_task(cfg)
        loaders, steps_per_epoch, global_batch = build_loaders(cfg, task, device, evaluating)
        dtype = getattr(torch, cfg.model.dtype)
        model = build_model(cfg, task, device, dtype)
        rate_batch = lr_batch(cfg.dist.op, global_batch, dist.size(), dist.local_size(),
                              device.type == "cuda" and dist.built()["nccl"])
        schedule = LRSchedule.from_config(cfg.optim, rate_batch, cfg.train.epochs, steps_per_epoch,
                                          rank_batch=cfg.train.batch_size, passes=cfg.train.backward_passes_per_step)
        amp_dtype, scaler = build_scaler(cfg, device)
        state = RunState(model, build_optimizer(cfg, model, schedule, device, task), scaler)
        for name, component in task.state_components().items():  # e.g. the shard loader's position, an id mapping
            state.register(name, component)
        if tracking.enabled(cfg):
            state.register("tracking", tracking.TrackingState())  # the trackers' run ids, carried by checkpoints
        settings = StepSettings(task=task, device=device, lr_schedule=schedule, dtype=dtype, amp_dtype=amp_dtype,
                                clip_grad_norm=cfg.optim.clip_grad_norm,
                                backward_passes_per_step=cfg.train.backward_passes_per_step,
                                steps_in_backward=cfg.dist.op == "adasum",
                                phase_timing=cfg.runtime.phase_timing, prefetch=cfg.runtime.prefetch, seed=cfg.seed,
                                # A host sync every step costs nothing on a CPU; on a GPU it would stall the queue.
                                guard=FiniteGuard(device, check_every=1 if device.type == "cpu" else 100,
                                                  max_skipped=cfg.amp.max_skipped_steps))
        run = Run(cfg=cfg, task=task, state=state, settings=settings, loaders=loaders, steps_per_epoch=steps_per_epoch,
                  global_batch=global_batch, run_dir=Path(cfg.output.dir), peers=peers, liveness=liveness,
                  watchdog=Watchdog(0 if elastic else cfg.dist.timeout_seconds, peers, dist.rank()),
                  timeline=TimelineWindow(cfg.runtime.timeline, step_range(cfg.runtime.timeline_steps))
                  if cfg.runtime.timeline else None,
                  stats=StatsSampler(cfg.runtime.stats_interval,
                                     device.index if device.type == "cuda" else None).start()
                  if cfg.runtime.stats_interval > 0 else None, warnings=tally, evaluating=evaluating,
                  claim=claim)

        world_size, passes = dist.size(), cfg.train.backward_passes_per_step
        # Horovod's controller matters to a job of several ranks (Gloo or MPI); one process has none to speak of.
        controller = f" ({dist.controller()} controller)" if world_size > 1 else ""
        if dist.engine() == "torch":  # torch.distributed's process group: a backend, no controller
            controller = f" (torch engine, {dist.controller()} backend)"
        log(f"hvdtrain: {'evaluating on ' if evaluating else ''}{world_size} rank{'s' if world_size > 1 else ''} on "
            f"{dist.cross_size()} host(s){controller}, device {device.type}, {threads} threads/rank"
            + ("" if threads_from == "its own cores" else f" ({threads_from})")
            + (f" on its own {len(own_cores)} of the host's cores" if own_cores else "")
            + (f", malloc {malloc}" if malloc else "")
            + ("; " + host_map([(p.rank, p.host) for p in peers]) if peers else "")  # every pid: ranks.tsv
            + ("; elastic" if elastic else ""))
        if loaders.note:
            log(f"hvdtrain: {loaders.note}")
        if run.stats is not None and device.type == "cuda" and not run.stats.has_gpu:
            log("hvdtrain: GPU statistics off: NVML is not available (pip install 'hvdtrain[gpu]' for nvidia-ml-py)")
        log(f"hvdtrain: {task.describe(loaders)}")
        if evaluating:
            log(f"hvdtrain: validation batches of {cfg.train.batch_size}/rank; every sample counted once")
            add_recipe_state(run, quiet=True)  # the EMA weights, if the checkpoint has them (eval.ema)
            undo.pop_all()  # the run owns them now (release)
            return run
        given = " (train.global_batch_size)" if cfg.train.global_batch_size else ""
        warm = cfg.optim.warmup_epochs > 0 and schedule.start_lr != schedule.peak_lr
        log(f"hvdtrain: global batch {global_batch}{given} = {cfg.train.batch_size}/rank x {world_size} ranks "
            f"x {passes} passes; lr "
            + (f"{schedule.start_lr:.4g} -> {schedule.peak_lr:.4g}" if warm else f"{schedule.peak_lr:.4g}")
            + rate_note(cfg, rate_batch, global_batch, world_size)
            + (f" over {cfg.optim.warmup_epochs:g} warm-up epochs" if warm else ", no warm-up")
            + f", {cfg.optim.schedule} schedule; {steps_per_epoch} steps/epoch"
            f"{'' if cfg.elastic.enabled else last_batch_note(cfg, loaders, world_size)}; "
            f"compression {compression_for(cfg, device)}; amp {cfg.amp.dtype if cfg.amp.enabled else 'off'}"
            + (f"; {cfg.model.dtype}" if cfg.model.dtype != "float32" else ""))
        if task.name == "image_classification":
            log(f"hvdtrain: recipe: {recipe_line(cfg, model, schedule)}")
        add_recipe_state(run)
        undo.pop_all()  # the run owns them now (release)
        return run


def rate_note(cfg: Config, rate_batch: int, global_batch: int, world_size: int) -> str:
    """The start-up line's words on the rate's unit: optim.base_lr's (per 256 images) and Horovod's
    example's (optim.lr_per_rank: one rank's batch), each with the other's value; Adasum's rule.
    Nothing for optim.lr, a rate as it is."""
    optim, rank_batch = cfg.optim, cfg.train.batch_size
    if optim.lr > 0:
        return ""
    if optim.lr_per_rank > 0:
        note = (f"optim.lr_per_rank {optim.lr_per_rank:.4g} for one rank's {rank_batch} images = "
                f"{optim.lr_per_rank * 256 / rank_batch:.4g} per 256")
    else:
        note = (f"optim.base_lr {optim.base_lr:.4g} per 256 images = {optim.base_lr * rank_batch / 256:.4g} for one "
                f"rank's {rank_batch}")
    if rate_batch != global_batch:
        note += f"; Adasum: for {rate_batch} images, not scaled by the {world_size} ranks"
    return f" ({note})"


def recipe_line(cfg: Config, model: torch.nn.Module, schedule: LRSchedule) -> str:
    """The resolved recipe in the terms a source's log uses (docs/recipes.md): the warm-up's first
    and last rates and how the rate steps, the weight-decay exemption, the loss, the augmentation
    strength, the validation crop and cadence, so that a run can be compared with its source before
    the first epoch ends."""
    from ..data.image.policies import strength
    from ..data.image.transforms import val_image_size, val_resize_size
    from ..optim.build import describe_exemption, describe_schedule

    optim, every = cfg.optim, cfg.eval.every_epochs
    size = val_image_size(cfg.data)
    model_cfg = cfg.model
    init = [text for on, text in ((model_cfg.conv_init != "default", f"convolutions Kaiming {model_cfg.conv_init}"),
                                  (model_cfg.head_init_std > 0, f"classifier N(0, {model_cfg.head_init_std:g})"),
                                  (model_cfg.zero_init_residual, "last BatchNorm of each block at 0"),
                                  (model_cfg.blurpool, "BlurPool")) if on]
    return (f"{describe_schedule(optim, schedule)}; {describe_exemption(model, optim)}; "
            f"{'init: ' + ', '.join(init) + '; ' if init else ''}loss {optim.loss}"
            f"{f' (targets > {optim.bce_target_threshold:g} set to 1)' if optim.bce_target_threshold else ''}, "
            f"label smoothing {optim.label_smoothing:g}; augmentation: {strength(cfg.augment)}"
            f"{f', mixup {cfg.augment.mixup_alpha:g}' if cfg.augment.mixup_alpha else ''}"
            f"{f', cutmix {cfg.augment.cutmix_alpha:g}' if cfg.augment.cutmix_alpha else ''}, crop area "
            f"{cfg.augment.scale}; validation {size} px center crop of {val_resize_size(cfg.data)} px "
            f"({cfg.data.val_interpolation}){', flip averaged' if cfg.eval.flip else ''}, "
            + ("every epoch" if every == 1 else f"after epochs {cfg.eval.offset_epochs + 1}, "
               f"{cfg.eval.offset_epochs + 1 + every}, ... and the last"))


def add_recipe_state(run: Run, quiet: bool = False) -> None:
    """The model EMA and the time-to-accuracy clock, when asked for: registered state components
    (checkpoints, resume and elastic commits carry them), the EMA updated after every optimizer step.
    ``quiet``: registered without their lines (an evaluation trains nothing)."""
    cfg = run.cfg
    say = (lambda line: None) if quiet else log
    if cfg.ema.decay > 0:
        run.ema = ModelEma(run.state.model, cfg.ema)
        run.state.register("ema", run.ema)
        run.settings.after_optimizer_step.append(run.ema.after_optimizer_step)
        say(f"hvdtrain: model EMA, decay {cfg.ema.decay:g} every {cfg.ema.every_steps} step(s)"
            + (f", timm warm-up (gamma {cfg.ema.warmup_gamma:g}, power {cfg.ema.warmup_power:g})"
               if cfg.ema.warmup else ""))
    if target_value(cfg) > 0:
        run.clock = TrainClock()
        run.state.register("clock", run.clock)
        name, key = target_metric_name(run)
        direction = metric_direction(run.task, name, key)
        say(f"hvdtrain: target: stop at val {name} {'>=' if direction == 'max' else '<='} {target_value(cfg):g}"
            + (" (train.target_top1 is the old name of train.target)" if cfg.train.target_top1 else ""))
    metric_direction(run.task, *best_metric_key(run))  # an undeclared direction stops before the first step


class TrainClock:
    """Wall seconds spent training (from the first step, summed over resumed runs), for the time to
    accuracy; a state component, so a resumed run continues the count."""

    def __init__(self) -> None:
        self.before = 0.0       # seconds of earlier runs (from the checkpoint)
        self.started: float | None = None

    def start(self) -> None:
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return self.before + (time.perf_counter() - self.started if self.started is not None else 0.0)

    def state_dict(self) -> dict[str, Any]:
        return {"seconds": self.seconds()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.before = float(state["seconds"])
        if self.started is not None:
            self.started = time.perf_counter()


def best_metric_key(run: Run) -> tuple[str, str]:
    """The validation metric that picks best.pt (``checkpoint.best_metric``, or the task's), and the
    config key that chose it."""
    return run.cfg.checkpoint.best_metric or run.task.best_metric, "checkpoint.best_metric"


def best_metric_name(run: Run) -> str:
    return best_metric_key(run)[0]


def target_metric_name(run: Run) -> tuple[str, str]:
    """The validation metric ``train.target`` applies to (``train.target_metric``, else best.pt's)."""
    if run.cfg.train.target_metric:
        return run.cfg.train.target_metric, "train.target_metric"
    return best_metric_key(run)


def is_better(task: Task, value: float, best: float | None, name: str) -> bool:
    """Whether ``value`` of metric ``name`` improves on ``best``, in the direction the task declares."""
    if not math.isfinite(value):
        return False  # a diverged epoch never becomes best.pt
    if best is None:
        return True
    return value > best if metric_direction(task, name, "checkpoint.best_metric") == "max" else value < best


def reaches(task: Task, value: float, target: float, name: str) -> bool:
    """Whether ``value`` of metric ``name`` is at the target or past it, in the task's direction."""
    return value >= target if metric_direction(task, name, "train.target_metric") == "max" else value <= target


def release(run: Run) -> None:
    """Stop what a run started beside its loop: the statistics sampler, the warning tally, the
    watchdog and the liveness service. A process may then start another run (the Python API called
    twice, a sweep in one process) without the first one's threads."""
    if run.stats is not None:
        run.stats.stop()
    if run.warnings is not None:
        run.warnings.uninstall()
    run.watchdog.stop()
    if run.liveness is not None:
        run.liveness.close()
    if run.claim is not None:
        run.claim.release()  # the run folder's lock


def where(run: Run) -> str:
    position = run.state.position
    return f"epoch {position.epoch + 1}" + (f", step {position.step_in_epoch}/{run.steps_per_epoch}"
                                            if position.step_in_epoch else "")
