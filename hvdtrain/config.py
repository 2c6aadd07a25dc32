"""Configuration: nested dataclasses, YAML files and dotted command-line overrides.

Precedence is defaults < YAML file < ``key=value`` overrides. Every field has a type and a
docstring-like comment; unknown keys and badly typed values stop with one line that names the
key and what would have been valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from .keys import ConfigError, field_types, set_key, type_name

__all__ = ["Config", "ConfigError", "load_config", "apply_override", "from_dict", "to_dict", "dump_yaml", "validate"]

PACKAGED_CONFIGS = Path(__file__).parent / "configs"
# The tasks that ship with hvdtrain: config name -> "module:Class" (hvdtrain/tasks).
TASKS = {"image_classification": "hvdtrain.tasks.image_classification:ImageClassification"}


@dataclass
class ModelConfig:
    arch: str = "resnet50"
    """Any torchvision classification model name (torchvision.models.list_models)."""
    num_classes: int = 0
    """0 = the number of class folders in the dataset (1000 with synthetic data)."""
    sync_bn: bool = False
    """Replace BatchNorm with Horovod's SyncBatchNorm (statistics over the global batch)."""
    dtype: Literal["float32", "float64"] = "float32"
    """Parameter and activation dtype; float64 is for numerical checks (e.g. N ranks vs one rank), several times slower."""


@dataclass
class DataConfig:
    dir: str = ""
    """Folder with train/ and val/ ImageFolder trees; empty = the built-in demo dataset."""
    image_size: int = 224
    """Training crop and validation center-crop size."""
    val_resize: int = 0
    """Validation resize before the center crop; 0 = image_size / 0.875 (256 for 224)."""
    augment: bool = True
    """RandomResizedCrop + flip for training; false = the deterministic validation transform."""
    synthetic: bool = False
    """Random tensors instead of files, for benchmarking the model and communication."""
    synthetic_samples: int = 1281167
    """Training samples per epoch with synthetic data (ImageNet-1k size by default); validation gets ImageNet's proportion (50000 at the default)."""
    workers: int = 4
    """DataLoader worker processes per rank (0 = load in the training process)."""
    mp_context: Literal["forkserver", "spawn", "fork"] = "forkserver"
    """Start method for loader workers; forkserver is safe after MPI/NCCL initialization."""
    prefetch_factor: int = 2
    """Batches each worker loads ahead."""
    on_bad_file: Literal["skip", "fail"] = "skip"
    """An undecodable image: skip = warn, count (bad_files) and replace it; fail = stop, naming the file."""
    index_cache: bool = True
    """Cache the file list of data.dir under $HVDTRAIN_CACHE (default ~/.cache/hvdtrain); false = scan at every start."""
    format: Literal["auto", "folder", "shards"] = "auto"
    """folder = an ImageFolder; shards = tar shards from hvdtrain prepare (docs/data.md); auto = shards when data.dir holds a manifest.json or is a URL (s3://...)."""
    shuffle_buffer: int = 1000
    """Shards: records each loader worker shuffles in its seeded buffer (more = better mixing, more memory)."""


@dataclass
class TrainConfig:
    epochs: int = 90
    """Number of epochs."""
    batch_size: int = 32
    """Images per rank per backward pass."""
    steps_per_epoch: int = 0
    """Optimizer steps per epoch; 0 = the whole epoch (a cap for quick runs)."""
    backward_passes_per_step: int = 1
    """Batches accumulated locally before each allreduce and optimizer step."""


@dataclass
class OptimConfig:
    base_lr: float = 0.1
    """Learning rate per 256 images; scaled linearly by the global batch (Goyal et al. 2017)."""
    momentum: float = 0.9
    """SGD momentum."""
    nesterov: bool = True
    """Nesterov momentum."""
    weight_decay: float = 1e-4
    """Applied to weights only: biases and normalization parameters get none."""
    warmup_epochs: float = 5.0
    """Linear warm-up from base_lr to the scaled learning rate over this many epochs."""
    schedule: Literal["step", "cosine"] = "step"
    """step: x0.1 at 30/60/80 of 90 epochs (scaled to train.epochs); cosine: to zero."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss (validation loss is plain cross-entropy)."""
    clip_grad_norm: float = 0.0
    """Clip the global gradient norm to this value after the allreduce; 0 = off."""


@dataclass
class DistConfig:
    compression: Literal["auto", "none", "fp16"] = "auto"
    """Gradient compression on the wire; auto = fp16 on GPU, none on CPU."""
    op: Literal["average", "adasum"] = "average"
    """Gradient reduction."""
    timeout_seconds: int = 45
    """Stop the job, naming the lost rank, when no training step completes for this long; 0 = never."""
    straggler_threshold: float = 0.15
    """Name a rank whose busy time per step (data + compute + optimizer) exceeds the median rank's by more than this; 0 = off."""
    stall_warning_seconds: int = 60
    """Horovod's stall inspector: warn when some ranks have not submitted a tensor the others wait on for this long; 0 = off."""
    stall_shutdown_seconds: int = 0
    """Horovod's stall inspector: shut the job down after a stall this long (above stall_warning_seconds); 0 = never."""


@dataclass
class AmpConfig:
    enabled: bool = False
    """Automatic mixed precision (torch.autocast)."""
    dtype: Literal["float16", "bfloat16"] = "float16"
    """float16 uses a GradScaler; bfloat16 needs none and also runs on CPU."""


@dataclass
class RuntimeConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto = CUDA when available, pinned by Horovod local rank."""
    threads: int = 0
    """torch intra-op threads per rank; 0 = CPU cores divided by the ranks on this host."""
    cudnn_benchmark: bool = True
    """Let cuDNN pick the fastest convolution algorithms (fixed input sizes)."""
    compile: bool = False
    """Compile the model with torch.compile (slower start; measure with hvdtrain bench)."""
    phase_timing: bool = True
    """Time each step's phases (data wait, forward+backward, allreduce wait, optimizer) per rank, and name stragglers."""
    stats_interval: float = 1.0
    """Seconds between samples of each rank's CPU, memory and (with NVML) GPU use, averaged per epoch; 0 = off."""
    timeline: str = ""
    """Write Horovod's timeline (Chrome trace JSON, with cycle marks) to this file; empty = off."""
    timeline_steps: str = ""
    """Global steps to record in the timeline, as START-END (e.g. 100-120); empty = the whole run."""


@dataclass
class OutputConfig:
    dir: str = "runs/hvdtrain"
    """Run directory: config.yaml, metrics.jsonl, tb/, checkpoints/."""
    progress: bool = True
    """Progress per epoch on rank 0: a bar on a terminal, a line every 10% when output is piped."""
    tensorboard: bool = True
    """tensorboardX scalars under <output.dir>/tb."""


@dataclass
class CheckpointConfig:
    resume: str = "auto"
    """auto = continue from the newest readable checkpoint in <output.dir>/checkpoints; never; or a file."""
    every_steps: int = 0
    """Also checkpoint every this many optimizer steps, mid-epoch; 0 = at the end of each epoch only."""
    keep: int = 3
    """Numbered checkpoints (step-N.pt) kept besides last.pt and best.pt; 0 = last.pt and best.pt only."""


@dataclass
class ElasticConfig:
    enabled: bool = False
    """Run under Horovod Elastic (launch with horovodrun --min-np/--max-np --host-discovery-script)."""
    commit_every_steps: int = 10
    """Commit the in-memory state every this many steps; a failure rolls back to the last commit."""
    sample_log: bool = False
    """Log every rank's sample indices of every committed step to <output.dir>/samples.jsonl, to audit a run."""


@dataclass
class Config:
    task: str = "image_classification"
    """The workload (hvdtrain/tasks): image_classification, or module:Class of your own task."""
    seed: int = 0
    """Seeds model initialization and the per-epoch shuffle (seed + epoch)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)


def apply_mapping(cfg: Config, mapping: dict[str, Any], source: str = "config") -> None:
    """Apply a nested mapping (as read from YAML) onto ``cfg``."""
    if mapping is None:
        return
    if not isinstance(mapping, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(mapping).__name__}")
    for key, value in mapping.items():
        set_key(cfg, str(key), value, from_text=False)


def apply_override(cfg: Config, text: str) -> None:
    """Apply one ``section.key=value`` override from the command line."""
    if "=" not in text:
        # A config file given without --config lands here: say how to give it.
        hint = f" (to read a config file, use --config {text})" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override '{text}' is not of the form section.key=value{hint}")
    key, value = text.split("=", 1)
    set_key(cfg, key.strip(), value.strip(), from_text=True)


def resolve_config_path(name_or_path: str) -> Path:
    """A path as given, or the name of a config shipped with hvdtrain (``debug``, ``demo``...)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = PACKAGED_CONFIGS / f"{name_or_path}.yaml"
    if packaged.is_file():
        return packaged
    shipped = ", ".join(sorted(p.stem for p in PACKAGED_CONFIGS.glob("*.yaml")))
    raise ConfigError(f"config file '{name_or_path}' not found (give a path, or one of: {shipped})")


def load_config(config_file: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, then the YAML file, then the overrides; validated."""
    cfg = Config()
    if config_file:
        path = resolve_config_path(config_file)
        try:
            mapping = yaml.safe_load(path.read_text())
        except yaml.YAMLError as error:
            first = str(error).splitlines()[0]
            raise ConfigError(f"config file '{path}' is not valid YAML: {first}") from None
        apply_mapping(cfg, mapping, source=str(path))
    for override in overrides:
        apply_override(cfg, override)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Cross-field and range checks, each failing with one line."""
    if cfg.task not in TASKS and ":" not in cfg.task:
        close = difflib.get_close_matches(cfg.task, TASKS, n=1)
        raise ConfigError(f"config key 'task': unknown task '{cfg.task}' ("
                          + (f"did you mean '{close[0]}'?" if close else
                             f"one of {', '.join(TASKS)}, or module:Class of your own") + ")")
    positive = {
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
    non_negative = {
        "train.steps_per_epoch": cfg.train.steps_per_epoch,
        "data.workers": cfg.data.workers,
        "data.val_resize": cfg.data.val_resize,
        "runtime.threads": cfg.runtime.threads,
        "checkpoint.every_steps": cfg.checkpoint.every_steps,
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
    }
    for key, value in non_negative.items():
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}")
    if cfg.optim.base_lr <= 0:
        raise ConfigError(f"config key 'optim.base_lr' must be positive, got {cfg.optim.base_lr}")
    if cfg.optim.label_smoothing >= 1:
        raise ConfigError(f"config key 'optim.label_smoothing' must be below 1, got {cfg.optim.label_smoothing}")
    if not cfg.output.dir:
        raise ConfigError("config key 'output.dir' must not be empty")
    if cfg.model.dtype == "float64" and cfg.amp.enabled:
        raise ConfigError("model.dtype=float64 and amp.enabled=true exclude each other (set amp.enabled=false)")
    stall = cfg.dist
    if stall.stall_shutdown_seconds and stall.stall_shutdown_seconds <= stall.stall_warning_seconds:
        raise ConfigError(f"config key 'dist.stall_shutdown_seconds' ({stall.stall_shutdown_seconds}) must exceed "
                          f"dist.stall_warning_seconds ({stall.stall_warning_seconds}), or be 0 (never)")
    step_range(cfg.runtime.timeline_steps)
    if cfg.runtime.timeline_steps and not cfg.runtime.timeline:
        raise ConfigError("config key 'runtime.timeline_steps' needs runtime.timeline=PATH (the file to write)")


def step_range(text: str) -> tuple[int, int] | None:
    """``runtime.timeline_steps``: "START-END" (global steps, END excluded) -> (start, end); "" -> None."""
    if not text:
        return None
    start, dash, end = text.partition("-")
    if not (dash and start.strip().isdigit() and end.strip().isdigit() and int(start) < int(end)):
        raise ConfigError(f"config key 'runtime.timeline_steps': expected START-END with START < END, "
                          f"e.g. 100-120, got '{text}'")
    return int(start), int(end)


def to_dict(cfg: Config) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(mapping: dict[str, Any]) -> Config:
    cfg = Config()
    apply_mapping(cfg, mapping)
    validate(cfg)
    return cfg


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def describe_keys() -> list[tuple[str, str, Any, str]]:
    """(key, type, default, doc) for every key: the README table is generated from this."""
    import ast
    import inspect

    rows = []

    def docs_of(cls: type) -> dict[str, str]:
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        found = {}
        for node, after in zip(body, body[1:] + [None]):
            if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
                found[node.target.id] = " ".join(str(after.value.value).split())  # type: ignore[union-attr]
        return found

    def walk(cls: type, prefix: str, instance: Any) -> None:
        docs = docs_of(cls)
        for name, tp in field_types(cls).items():
            value = getattr(instance, name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", value)
            else:
                rows.append((f"{prefix}{name}", type_name(tp), value, docs.get(name, "")))

    walk(Config, "", Config())
    return rows
