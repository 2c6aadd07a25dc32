"""Configuration: nested dataclasses, YAML files and dotted command-line overrides.

Precedence is defaults < YAML file < ``key=value`` overrides. Every field has a type and a
docstring-like comment; unknown keys and badly typed values stop with one line that names the
key and what would have been valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

PACKAGED_CONFIGS = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A configuration problem, phrased as one line for the user."""


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
    """Training samples per epoch with synthetic data (ImageNet-1k size by default)."""
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


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any, from_text: bool) -> Any:
    """Turn ``value`` into ``tp`` or raise a one-line ConfigError naming ``key``."""

    def bad() -> ConfigError:
        return ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {value!r}")

    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        text = str(value) if from_text or isinstance(value, str) else value
        if text not in choices:
            raise bad()
        return text
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_text and str(value).lower() in ("true", "false", "yes", "no", "1", "0", "on", "off"):
            return str(value).lower() in ("true", "yes", "1", "on")
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-4" as a string
            try:
                return float(value)
            except ValueError:
                raise bad() from None
        raise bad()
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        if value is None:
            return ""
        raise bad()
    raise TypeError(f"unsupported config field type {tp!r} for {key}")


def _set(cfg: Any, dotted: str, value: Any, from_text: bool) -> None:
    parts = dotted.split(".")
    node = cfg
    for depth, name in enumerate(parts):
        types = _field_types(type(node))
        prefix = ".".join(parts[:depth])
        if name not in types:
            where = f" in '{prefix}'" if prefix else ""
            raise ConfigError(f"unknown config key '{dotted}' (valid keys{where}: {', '.join(sorted(types))})"
                              + _did_you_mean(dotted))
        tp = types[name]
        last = depth == len(parts) - 1
        if dataclasses.is_dataclass(tp):
            if last:
                if not isinstance(value, dict):
                    raise ConfigError(f"config key '{dotted}' is a section; set its keys ({', '.join(sorted(_field_types(tp)))})")
                for sub_key, sub_value in value.items():
                    _set(cfg, f"{dotted}.{sub_key}", sub_value, from_text)
                return
            node = getattr(node, name)
        else:
            if not last:
                raise ConfigError(f"config key '{'.'.join(parts[:depth + 1])}' is a value, not a section")
            setattr(node, name, _coerce(dotted, value, tp, from_text))


def _all_keys(cls: type | None = None, prefix: str = "") -> list[str]:
    """Every dotted key, sections included ('train' and 'train.epochs'), in declaration order."""
    keys = []
    for name, tp in _field_types(cls or Config).items():
        keys.append(prefix + name)
        if dataclasses.is_dataclass(tp):
            keys += _all_keys(tp, f"{prefix}{name}.")
    return keys


def suggest_keys(dotted: str, limit: int = 2) -> list[str]:
    """The valid keys nearest to a mistyped one, best first; empty when none is near.

    A right key in the wrong section or without its section ('train.base_lr', 'batch_size') is
    found by its last part. Otherwise the whole dotted key is compared with the keys of as many
    parts, so that a typo in the section ('trian.epochs') is found as well as one in the key
    ('train.epoch'). Only matches about as close as the best are kept: a list of far guesses
    would hide the one that helps.
    """
    keys = [key for key in _all_keys() if key != dotted]
    leaf = dotted.rsplit(".", 1)[-1]
    same_leaf = [key for key in keys if key.rsplit(".", 1)[-1] == leaf]
    same_depth = [key for key in keys if key.count(".") == dotted.count(".")]
    scored = sorted(((difflib.SequenceMatcher(None, dotted, key).ratio(), key) for key in same_depth),
                    reverse=True)
    best = scored[0][0] if scored else 0.0
    close = [key for score, key in scored if score >= 0.7 and score >= best - 0.1]
    return list(dict.fromkeys(same_leaf + close))[:limit]


def _did_you_mean(dotted: str) -> str:
    """'; did you mean 'a'?' for an unknown key, or nothing when no valid key is near."""
    found = suggest_keys(dotted)
    return f"; did you mean {' or '.join(repr(key) for key in found)}?" if found else ""


def apply_mapping(cfg: Config, mapping: dict[str, Any], source: str = "config") -> None:
    """Apply a nested mapping (as read from YAML) onto ``cfg``."""
    if mapping is None:
        return
    if not isinstance(mapping, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections, got {type(mapping).__name__}")
    for key, value in mapping.items():
        _set(cfg, str(key), value, from_text=False)


def apply_override(cfg: Config, text: str) -> None:
    """Apply one ``section.key=value`` override from the command line."""
    if "=" not in text:
        # A config file given without --config lands here: say how to give it.
        hint = f" (to read a config file, use --config {text})" if text.endswith((".yaml", ".yml")) else ""
        raise ConfigError(f"override '{text}' is not of the form section.key=value{hint}")
    key, value = text.split("=", 1)
    _set(cfg, key.strip(), value.strip(), from_text=True)


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
        for name, tp in _field_types(cls).items():
            value = getattr(instance, name)
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{name}.", value)
            else:
                rows.append((f"{prefix}{name}", _type_name(tp), value, docs.get(name, "")))

    walk(Config, "", Config())
    return rows
