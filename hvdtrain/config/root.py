"""The root of the configuration: the core sections, plus the section of the task when it has one.

A task that declares settings (``Task.settings``: a dataclass, docs/tasks.md) gets them as a section
named after the task (``recommendation.embedding_dim``, ``my_task.hidden``). Which section is valid
depends on the task, and the task may be named last, so keys of a section that is not a core one
wait in the config (``waiting``) until ``bind_section`` mounts the task's section: the config then
becomes an instance of ``config_type(section, settings)``, a subclass of ``Config`` with one more
field, so that everything that walks the dataclass (``key=value``, ``--print-config``, config.yaml,
checkpoints, the resume comparison) sees the task's keys like any other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable

from .keys import ConfigError, set_key
from .run_sections import CheckpointConfig, DistConfig, ElasticConfig, OutputConfig, RuntimeConfig, TrackingConfig
from .sections import AmpConfig, AugmentConfig, DataConfig, EmaConfig, EvalConfig, ModelConfig, OptimConfig, TrainConfig

# Keys that moved from a core section into a task's own: the old key -> the new one. A
# config file or override that uses an old key stops with one line naming the new one; a config
# recorded by an earlier run is carried over (load.migrate_moved_keys).
MOVED_KEYS = {
    **{f"model.{key}": f"recommendation.{key}"
       for key in ("objective", "embedding_dim", "mlp_layers", "embedding_l2", "sparse_embeddings")},
    **{f"data.{key}": f"recommendation.{key}"
       for key in ("split", "split_fraction", "negatives", "eval_negatives", "on_bad_line", "ratings_cache")},
}


@dataclass
class Config:
    task: str = "image_classification"
    """The workload (hvdtrain/tasks): image_classification, recommendation, or your own task as module:Class or
    path/to/file.py:Class (docs/tasks.md)."""
    seed: int = 0
    """Seeds model initialization and the per-epoch shuffle (seed + epoch)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    amp: AmpConfig = field(default_factory=AmpConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # Not a field: read by keys.set_key for its one-line message about a key that moved.
    MOVED_KEYS: ClassVar[dict[str, str]] = MOVED_KEYS

    def __post_init__(self) -> None:
        # (dotted key, value, from_text) of sections that are not core ones, in the order given:
        # they wait for the task's section (bind_section). Not a field: never recorded.
        self.waiting: list[tuple[str, Any, bool]] = []

    def __reduce__(self) -> tuple[Any, ...]:
        # A config with a task's section is of a class made at run time: pickle it (loader workers
        # started by forkserver, deep copies) by its section and settings class instead.
        section = task_section(self)
        settings = type(getattr(self, section)) if section else None
        return rebuild, (section, settings, dict(self.__dict__))


CORE_SECTIONS = frozenset(f.name for f in dataclasses.fields(Config))
_TYPES: dict[tuple[str, type], type[Config]] = {}


def config_type(section: str, settings: type | None) -> type[Config]:
    """``Config``, or its subclass with the task's section ``section`` of dataclass ``settings``."""
    if not section or settings is None:
        return Config
    key = (section, settings)
    if key not in _TYPES:
        made = dataclasses.make_dataclass(f"Config_{section}", [(section, settings, field(default_factory=settings))],
                                          bases=(Config,))
        made.__module__ = __name__
        _TYPES[key] = made
    return _TYPES[key]


def rebuild(section: str, settings: type | None, state: dict[str, Any]) -> Config:
    cfg = object.__new__(config_type(section, settings))
    cfg.__dict__.update(state)
    return cfg


def task_section(cfg: Config) -> str:
    """The name of the task's section ``cfg`` carries, or "" (none)."""
    return next((f.name for f in dataclasses.fields(cfg) if f.name not in CORE_SECTIONS), "")


def bind_section(cfg: Config, section: str, settings: type | None, known_tasks: Iterable[str] = ()) -> None:
    """Mount the task's section on ``cfg`` (in place: ``cfg`` keeps its identity) and set the keys
    waiting for it; a key that fits no section stops with one line. A section of another task's
    (``known_tasks``) says which task it belongs to."""
    target = config_type(section, settings)
    if type(cfg) is not target:
        previous = task_section(cfg)
        cfg.__class__ = target
        if previous and previous != section:
            del cfg.__dict__[previous]
        if section and settings is not None and section not in cfg.__dict__:
            setattr(cfg, section, settings())
    waiting, cfg.waiting = cfg.waiting, []
    for dotted, value, from_text in waiting:
        top = dotted.split(".", 1)[0]
        if top in known_tasks and top != section:
            raise ConfigError(f"config section '{top}' holds the keys of task={top}, but this config's task is "
                              f"{cfg.task}: set task={top}, or remove the section")
        set_key(cfg, dotted, value, from_text, wait=False)
