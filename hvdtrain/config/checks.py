"""Checks of the core sections: ranges, bounds and keys that exclude each other, each one line."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .keys import ConfigError
from .recipe_checks import validate_finetune_and_augment, validate_recipes
from .root import Config


def check_core(cfg: Config) -> None:
    """Cross-field and range checks of the core sections, each failing with one line (a task's own
    section is checked by its settings class: config/load.py)."""
    positive: dict[str, float] = {
        "train.epochs": cfg.train.epochs,
        "train.batch_size": cfg.train.batch_size,
        "train.backward_passes_per_step": cfg.train.backward_passes_per_step,
        "data.image_size": cfg.data.image_size,
        "data.prefetch_factor": cfg.data.prefetch_factor,
        "data.synthetic_samples": cfg.data.synthetic_samples,
        "elastic.commit_every_steps": cfg.elastic.commit_every_steps,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"config key '{key}' must be positive, got {value}")
    non_negative: dict[str, float] = {
        "train.steps_per_epoch": cfg.train.steps_per_epoch,
        "train.global_batch_size": cfg.train.global_batch_size,
        "optim.lr": cfg.optim.lr,
        "optim.lr_per_rank": cfg.optim.lr_per_rank,
        "data.val_resize": cfg.data.val_resize,
        "runtime.threads": cfg.runtime.threads,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
        "output.progress_every_steps": cfg.output.progress_every_steps,
        "runtime.audit_every": cfg.runtime.audit_every,
        "amp.max_skipped_steps": cfg.amp.max_skipped_steps,
        "dist.timeout_seconds": cfg.dist.timeout_seconds,
        "checkpoint.keep": cfg.checkpoint.keep,
        "model.num_classes": cfg.model.num_classes,
        "optim.warmup_epochs": cfg.optim.warmup_epochs,
        "optim.weight_decay": cfg.optim.weight_decay,
        "optim.label_smoothing": cfg.optim.label_smoothing,
        "optim.clip_grad_norm": cfg.optim.clip_grad_norm,
        "dist.straggler_threshold": cfg.dist.straggler_threshold,
        "runtime.stats_interval": cfg.runtime.stats_interval,
        "dist.stall_warning_seconds": cfg.dist.stall_warning_seconds,
        "dist.stall_shutdown_seconds": cfg.dist.stall_shutdown_seconds,
        "data.shuffle_buffer": cfg.data.shuffle_buffer,
        "data.max_image_pixels": cfg.data.max_image_pixels,
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}")
    check_upper_bounds(cfg)
    if cfg.data.workers < -1:
        raise ConfigError(f"config key 'data.workers' must be >= 0, or -1 for auto, got {cfg.data.workers}")
    if cfg.dist.gradient_predivide_factor <= 0 or (cfg.dist.gradient_predivide_factor != 1 and cfg.dist.op == "adasum"):
        raise ConfigError(f"config key 'dist.gradient_predivide_factor' must be positive, and 1 with dist.op=adasum "
                          f"(Horovod splits an average, not Adasum), got {cfg.dist.gradient_predivide_factor:g}")
    if cfg.optim.lr and cfg.optim.lr_per_rank:
        raise ConfigError(f"optim.lr={cfg.optim.lr:g} and optim.lr_per_rank={cfg.optim.lr_per_rank:g} both set the "
                          "rate: set one of the two")
    if cfg.dist.bucket_mb < 0 and cfg.dist.bucket_mb != -1:
        raise ConfigError(f"config key 'dist.bucket_mb' must be >= 0 (MB), or -1 for auto, got {cfg.dist.bucket_mb}")
    # Gradient groups and what rules them out. Horovod's grouped DistributedOptimizer broadcasts the
    # parameter order when it is built, which a worker joining a running elastic job does alone.
    if cfg.dist.bucket_mb > 0 and cfg.elastic.enabled:
        raise ConfigError(f"dist.bucket_mb={cfg.dist.bucket_mb:g} cannot be used with elastic.enabled=true (a joining "
                          "worker would wait alone in the grouped optimizer's broadcast): leave dist.bucket_mb at -1 "
                          "(auto) or 0")
    if cfg.checkpoint.every_steps and cfg.elastic.enabled:
        raise ConfigError(f"checkpoint.every_steps={cfg.checkpoint.every_steps} cannot be used with "
                          "elastic.enabled=true (elastic runs commit their state in memory every "
                          "elastic.commit_every_steps steps and checkpoint at each epoch end): set "
                          "checkpoint.every_steps=0")
    if cfg.runtime.cpu_affinity == "rank" and cfg.elastic.enabled:
        raise ConfigError("runtime.cpu_affinity=rank cannot be used with elastic.enabled=true (the ranks on a host "
                          "change as workers come and go): leave it at auto or none")
    if not cfg.train.drop_last and cfg.train.backward_passes_per_step > 1:
        raise ConfigError(f"train.backward_passes_per_step={cfg.train.backward_passes_per_step} also needs "
                          "train.drop_last=true, and it is false here (as the pytorch_examples preset sets it, to "
                          "train on main.py's last partial batch): a partial batch among accumulated passes would "
                          "weigh its samples more than the others'; add train.drop_last=true, or keep "
                          "train.backward_passes_per_step=1")
    if cfg.train.global_batch_size and cfg.elastic.enabled:
        raise ConfigError(f"train.global_batch_size={cfg.train.global_batch_size} cannot be used with "
                          "elastic.enabled=true (an elastic run keeps train.batch_size per rank as ranks come and "
                          "go): set train.batch_size instead")
    if not (cfg.optim.warmup_start == -1 or 0 <= cfg.optim.warmup_start <= 1):
        raise ConfigError(f"config key 'optim.warmup_start' is a fraction of the peak rate in [0, 1], or -1 "
                          f"(from optim.base_lr), got {cfg.optim.warmup_start}")
    if cfg.optim.base_lr <= 0:
        raise ConfigError(f"config key 'optim.base_lr' must be positive, got {cfg.optim.base_lr}")
    if cfg.optim.label_smoothing >= 1:
        raise ConfigError(f"config key 'optim.label_smoothing' must be below 1, got {cfg.optim.label_smoothing}")
    if not cfg.output.dir:
        raise ConfigError("config key 'output.dir' must not be empty")
    if not cfg.output.tensorboard and (cfg.output.tensorboard_dir or cfg.output.tensorboard_tags != "hvdtrain"):
        raise ConfigError("output.tensorboard_dir and output.tensorboard_tags need output.tensorboard=true")
    if cfg.model.dtype == "float64" and cfg.amp.enabled:
        raise ConfigError("model.dtype=float64 and amp.enabled=true exclude each other (set amp.enabled=false)")
    stall = cfg.dist
    if stall.stall_shutdown_seconds and stall.stall_shutdown_seconds <= stall.stall_warning_seconds:
        raise ConfigError(f"config key 'dist.stall_shutdown_seconds' ({stall.stall_shutdown_seconds}) must exceed "
                          f"dist.stall_warning_seconds ({stall.stall_warning_seconds}), or be 0 (never)")
    step_range(cfg.runtime.timeline_steps)
    check_engine(cfg)
    validate_finetune_and_augment(cfg)
    validate_recipes(cfg)
    if cfg.runtime.timeline_steps and not cfg.runtime.timeline:
        raise ConfigError("config key 'runtime.timeline_steps' needs runtime.timeline=PATH (the file to write)")
    if cfg.runtime.preemption_poll_seconds <= 0:
        raise ConfigError("config key 'runtime.preemption_poll_seconds' must be positive, "
                          f"got {cfg.runtime.preemption_poll_seconds}")
    if cfg.runtime.preemption_notice_url and cfg.runtime.preemption_notice == "none":
        raise ConfigError("config key 'runtime.preemption_notice_url' is set but runtime.preemption_notice=none: "
                          "name the cloud (aws, azure or gcp)")
    if cfg.runtime.preemption_notice_url and not cfg.runtime.preemption_notice_url.startswith(("http://", "https://")):
        raise ConfigError(f"config key 'runtime.preemption_notice_url': expected an http:// or https:// URL, "
                          f"got '{cfg.runtime.preemption_notice_url}'")
    if cfg.tracking.every_steps < 0 or cfg.tracking.flush_seconds < 0:
        key = "every_steps" if cfg.tracking.every_steps < 0 else "flush_seconds"
        raise ConfigError(f"config key 'tracking.{key}' must be >= 0, got {getattr(cfg.tracking, key)}")
    if cfg.tracking.log_checkpoints != "none" and not (cfg.tracking.wandb.enabled or cfg.tracking.mlflow.enabled):
        raise ConfigError(f"config key 'tracking.log_checkpoints={cfg.tracking.log_checkpoints}' needs a tracker "
                          "(tracking.wandb.enabled=true or tracking.mlflow.enabled=true)")


# Upper bounds of the keys that start processes or threads or allocate in proportion to their value:
# beyond them a typo (workers=100000, image_size=100000, threads=1000000) hung for minutes or ended
# in an allocator traceback. Absolute numbers, not multiples of this machine's cores, so that a
# config valid on a login node is valid on the compute nodes; each far above real use.
UPPER_BOUNDS = {
    # A 2-socket node has about 256 hardware threads for all of its ranks.
    "data.workers": (256, "loader processes per rank"),
    # Training activations grow with the pixels: ResNet-50 needs about 0.1 GB per 224 px image, so
    # one 4096 px image some 30 GB; larger images fit no GPU.
    "data.image_size": (4096, "pixels a side"),
    "data.val_image_size": (4096, "pixels a side"),
    "data.min_res": (4096, "pixels a side"),
    "data.max_res": (4096, "pixels a side"),
    "data.val_resize": (8192, "pixels, the resize before the center crop"),
    "augment.pad": (4096, "pixels on each side"),
    # 2 to 4 batches in flight keep a loader busy; more only hold memory.
    "data.prefetch_factor": (64, "batches each worker loads ahead"),
    # Image tasks fit a few hundred per GPU; recommenders use up to 2^20 (MLPerf NCF's global batch).
    "train.batch_size": (1 << 20, "samples per rank"),
    # 45x ImageNet-21k; a 2048-wide head is then 8 GB of float32, mixup's soft targets more.
    "model.num_classes": (1_000_000, "classes"),
    "augment.magnitude_bins": (1024, "levels; RandAugment uses 31"),
    "augment.num_ops": (64, "operations per image; RandAugment uses 2"),
    # The largest machines have about 1000 hardware threads.
    "runtime.threads": (1024, "torch threads per rank"),
    # An epoch of synthetic data: 75x ImageNet-21k's 14.2M images. 4,000,000,000 used to be taken and
    # kept a rank at full CPU, deaf to SIGTERM, for over ten minutes.
    "data.synthetic_samples": (1 << 30, "samples an epoch"),
    # Records each loader worker holds to shuffle: a million images of ~110 KB are 110 GB already.
    "data.shuffle_buffer": (1 << 20, "records held per loader worker"),
    # Pillow refuses above its limit; 1 Gpixel is a 32768 x 32768 image, 3 GB decoded.
    "data.max_image_pixels": (1 << 30, "pixels an image may have"),
    # Each step consumes this many batches; recipes use up to 64.
    "train.backward_passes_per_step": (1024, "batches per optimizer step"),
    # A loop over epochs: 90 for ImageNet, a few thousand for small data sets.
    "train.epochs": (100_000, "epochs"),
    # Horovod's fusion buffer, allocated on every rank; its default is 128 MB.
    "dist.bucket_mb": (16384, "MB per gradient group"),
}


def check_upper_bounds(cfg: Config) -> None:
    for key, (bound, unit) in UPPER_BOUNDS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value > bound:
            raise ConfigError(f"config key '{key}' must be at most {bound} ({unit}), got {value}")


@dataclass(frozen=True)
class HorovodOnly:
    """A setting only the Horovod engine honours: refused under dist.engine=torch in one line."""

    key: str  # the config key that asks for it
    setting: str  # the values that ask for it, as docs/launching.md ("Two engines") lists them
    feature: str  # what of Horovod's it needs
    asks: Callable[[Any], bool]  # whether the key's value asks for it


# The one list of the Horovod-only settings: the config's check (check_engine), the torch engine's
# own refusal at init (comm/dist.py) and docs/launching.md's table (tests/unit/test_torch_engine.py).
HOROVOD_ONLY = (
    HorovodOnly("elastic.enabled", "elastic.enabled=true", "Horovod Elastic", bool),
    HorovodOnly("runtime.timeline", "runtime.timeline=PATH", "Horovod's timeline", bool),
    HorovodOnly("dist.stall_shutdown_seconds", "dist.stall_shutdown_seconds > 0", "Horovod's stall inspector",
                lambda seconds: seconds > 0),
    HorovodOnly("dist.op", "dist.op=adasum", "Horovod's Adasum", lambda op: op == "adasum"),
    HorovodOnly("dist.gradient_predivide_factor", "dist.gradient_predivide_factor != 1", "Horovod's pre-division",
                lambda factor: factor != 1),
)


def check_engine(cfg: Config) -> None:
    """Under dist.engine=torch, one line for each Horovod-only setting (HOROVOD_ONLY); under Adasum,
    for what needs the gradients between backward and the step: Horovod's Adasum optimizer steps
    each rank on its own gradients during backward and combines the updates."""
    for only in HOROVOD_ONLY if cfg.dist.engine == "torch" else ():
        section, name = only.key.split(".")
        if only.asks(getattr(getattr(cfg, section), name)):
            raise ConfigError(horovod_only(only.key, only.feature))
    for setting, excluded, fix in (
            (f"optim.clip_grad_norm={cfg.optim.clip_grad_norm:g}", cfg.optim.clip_grad_norm > 0,
             "optim.clip_grad_norm=0"),
            ("amp.dtype=float16 (its GradScaler)", cfg.amp.enabled and cfg.amp.dtype == "float16",
             "amp.dtype=bfloat16 (no scaler) or amp.enabled=false")):
        if cfg.dist.op == "adasum" and excluded:
            raise ConfigError(f"dist.op=adasum and {setting} exclude each other: Horovod's Adasum steps each rank "
                              "on its own gradients during backward, before they could be clipped or unscaled; "
                              f"set {fix}, or dist.op=average")


def horovod_only(key: str, feature: str) -> str:
    """The one line that refuses a Horovod-only ``feature`` (set by config ``key``) under the torch
    engine; comm/dist.py's init says the same to a caller that skipped the config."""
    return (f"config key '{key}' needs {feature}, which dist.engine=torch does not have: set dist.engine=horovod "
            f"(and launch with horovodrun) or turn {key} off")


def validates_after(cfg: Config, epoch: int) -> bool:
    """Whether the run validates after ``epoch`` (0-based): eval.every_epochs and eval.offset_epochs,
    and always after the last epoch."""
    every, offset = cfg.eval.every_epochs, cfg.eval.offset_epochs
    return epoch + 1 >= cfg.train.epochs or (epoch >= offset and (epoch - offset) % every == 0)


def step_range(text: str) -> tuple[int, int] | None:
    """``runtime.timeline_steps``: "START-END" (global steps, END excluded) -> (start, end); "" -> None."""
    if not text:
        return None
    start, dash, end = text.partition("-")
    if not (dash and start.strip().isdigit() and end.strip().isdigit() and int(start) < int(end)):
        raise ConfigError(f"config key 'runtime.timeline_steps': expected START-END with START < END, "
                          f"e.g. 100-120, got '{text}'")
    return int(start), int(end)
