"""The Python API: ``hvdtrain.fit(task, config)`` and ``hvdtrain.evaluate(checkpoint)`` from a script.

A script that calls ``fit`` runs under any launcher, as ``python -m hvdtrain`` does::

    horovodrun -np 2 python my_train.py
    mpirun -np 2 -bind-to none -map-by slot python my_train.py
    srun --mpi=pmix -n 2 python my_train.py

``fit`` is the CLI's train command with the config built from Python values: both run ``train``
(the static loop, or the elastic one under ``elastic.enabled``), so resume,
checkpoints, SIGTERM/SIGUSR1, the watchdog, metrics.jsonl and tensorboard behave exactly as there.
It also ends the process the way the CLI does where the CLI would: one line and ``SystemExit(2)``
for a bad config or task, ``SystemExit(75)`` after a preemption checkpoint (resume by running the
script again), ``SystemExit(1)`` when a rank is lost (the codes: outcome.py). The CLI (cli.py) is a
thin layer over this module: its train and evaluate commands call ``train`` and
``evaluate_checkpoint_file``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping, Union

from . import outcome
from .arguments import require_data_choice
from .config import Config, ConfigError, apply_mapping, apply_override, from_dict, to_dict
from .config.files import resolve_config_path
from .job_config import load_config, resolve_output, validate

if TYPE_CHECKING:  # torch and the tasks load only when a run starts
    import torch

    from .tasks import Task

ConfigSource = Union[None, str, Path, Mapping[str, Any], Iterable[str], Config]
TaskSource = Union[None, str, "type[Task]", "Task"]


@dataclass
class FitResult:
    """What ``fit`` returns on every rank."""

    model: "torch.nn.Module"
    """The trained model, identical on every rank (unwrapped: no DistributedOptimizer, no prefixes)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The last epoch trained: {"train": {...}, "val": {...}, "epoch": N, "step": S}; {} if none was."""
    run_dir: Path = Path()
    """output.dir: config.yaml, metrics.jsonl, tb/, checkpoints/ (written by rank 0)."""
    config: Config = field(default_factory=Config)
    """The resolved config the run used."""
    rank: int = 0
    size: int = 1


def build_config(config: ConfigSource = None, overrides: Iterable[str] = (), task: TaskSource = None) -> Config:
    """Defaults < ``config`` (a YAML path or shipped config name, a nested or dotted dict, a list of
    ``key=value``, or a Config) < ``overrides`` < ``task``; validated."""
    # Validated once, at the end: the task's section is known only once ``task`` has had its say.
    config_name, from_file = None, None
    if isinstance(config, Config):
        cfg = from_dict(to_dict(config))
    elif isinstance(config, (str, Path)):
        cfg = load_config(config, check=False)
        config_name, from_file = resolve_config_path(config).stem, cfg.output.dir
    elif isinstance(config, Mapping):
        cfg = Config()
        apply_mapping(cfg, dict(config), source="fit(config=...)")
    elif config is None:
        cfg = Config()
    else:
        cfg = Config()
        overrides = [*config, *overrides]
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of key=value strings, got the string '{overrides}'")
    overrides = list(overrides)
    for override in overrides:
        apply_override(cfg, override)
    if task is not None:
        cfg.task = task if isinstance(task, str) else provide_task(task)
    named_here = any(str(text).split("=", 1)[0].strip() == "output.dir" for text in overrides)
    resolve_output(cfg, config_name, from_file=from_file is not None and cfg.output.dir == from_file and not named_here)
    validate(cfg)
    return cfg


def provide_task(task: Any) -> str:
    from .tasks import Task, provide

    if not (isinstance(task, Task) or isinstance(task, type)):
        raise ConfigError(f"task must be a Task subclass, an instance of one, or a 'task' config string, "
                          f"got {type(task).__name__} (the task interface: docs/tasks.md)")
    return provide(task)


def check_task(cfg: Config) -> None:
    """Load and check the task class now: a task that cannot load stops before Horovod starts."""
    from .tasks import provided, task_class

    if not provided(cfg.task):
        task_class(cfg.task)


def fit(task: TaskSource = None, config: ConfigSource = None, overrides: Iterable[str] = ()) -> FitResult:
    """Train ``task`` with ``config`` on the ranks of this job; see the module docstring.

    ``task``: a Task subclass, an instance of one (its ``cfg`` becomes the run's config), or a
    ``task`` config string (``image_classification``, ``module:Class``, ``path/to/file.py:Class``);
    None keeps the config's. ``config``: a YAML path, a dict (``{"train": {"epochs": 3}}`` or
    ``{"train.epochs": 3}``), a list of ``key=value`` strings, or a Config; ``overrides`` apply last.
    """
    with one_line_errors():
        cfg = build_config(config, overrides, task)
        require_data_choice(None if config is None else "config", cfg)
    return fit_config(cfg)


def fit_config(cfg: Config) -> FitResult:
    """``fit`` of a config already built by ``build_config`` (its task handed over): the short
    path (simple.py) builds its own."""
    with one_line_errors():
        check_task(cfg)
        from .train.preflight import check_before_launch

        check_before_launch(cfg)  # what the ranks would refuse of the model, before Horovod starts
        code, run, last = train(cfg)
        if code:
            raise SystemExit(code)
        from .comm import dist  # loaded by the run

        return FitResult(model=run.state.model, metrics=last, run_dir=run.run_dir, config=cfg,
                         rank=dist.rank(), size=dist.size())


def run_training(cfg: Config):
    """The one training loop (trainer.Trainer), static or under Horovod Elastic as ``elastic.enabled``
    says. Returns the run and its last epoch's metrics."""
    from .train.trainer import Trainer

    return Trainer(cfg).fit()


def train(cfg: Config) -> tuple[int, Any, dict[str, Any]]:
    """Run ``cfg`` to its end on the ranks of this job: (exit code, the run, its last epoch's
    metrics). A run that stops early (preemption, a lost rank) gives its code by the one map
    (outcome.stop_code) and no run; the user's errors propagate."""
    from .train.guard import JobStopped
    from .train.stops import Preempted

    try:
        run, last = run_training(cfg)
    except (Preempted, JobStopped) as stop:
        return outcome.stop_code(stop), None, {}
    return outcome.EXIT_OK, run, last


def evaluate(checkpoint: str | Path, overrides: Iterable[str] | Mapping[str, Any] = (),
             task: TaskSource = None) -> dict[str, Any]:
    """The validation metrics of a checkpoint, summed exactly over the ranks of this job (every rank
    gets them). The config comes from the checkpoint; ``overrides`` (``key=value`` strings or a dict)
    change it (data.dir=..., runtime.threads=...). A task of your own must be named here (``task``:
    the class, an instance, or its ``task`` string), unless this process handed it to ``fit``
    already: no code named only inside a checkpoint is imported (``checkpoint_config``)."""
    with one_line_errors():
        return evaluate_checkpoint_file(Path(checkpoint), overrides, task,
                                        how="evaluate(..., task=MyTask) or task='my_task.py:MyTask'")


def evaluate_checkpoint_file(path: Path, overrides: Iterable[str] | Mapping[str, Any] = (), task: TaskSource = None,
                             how: str = "--task my_task.py:MyTask") -> dict[str, Any]:
    """``evaluate`` without its error handling (the CLI reports errors itself); ``how`` says how to
    name a task of one's own in the caller's terms."""
    cfg = checkpoint_config(path, overrides, task, how=how)
    check_task(cfg)
    from .train.resume import evaluate_checkpoint

    return evaluate_checkpoint(cfg, path)


def checkpoint_config(path: Path, overrides: Iterable[str] | Mapping[str, Any] = (), task: TaskSource = None,
                      how: str = "--task my_task.py:MyTask") -> Config:
    """The config that evaluates a checkpoint: the one it records (Horovod's example's records none:
    the ``horovod_example`` preset, the example's recipe), then ``overrides``, with the task the
    caller names (``task``, or a ``task`` override) checked against the recorded one.

    Names in a checkpoint are data, not code: a recorded task that is not built in is never
    imported (tasks.checkpoint_task), and no other recorded value reaches an import (model.arch
    names a torchvision or timm registry entry, everything else resolved by name is a fixed
    choice)."""
    from .checkpoint import io as checkpoints  # torch: after the arguments are in
    from .tasks import checkpoint_task

    payload = checkpoints.load(path)
    if payload.get("written_by") == checkpoints.HOROVOD_EXAMPLE:  # no config inside: the example's recipe
        cfg = load_config(checkpoints.HOROVOD_EXAMPLE)
    else:
        cfg = from_dict(payload["config"], stored=True)
    recorded = cfg.task
    if isinstance(overrides, Mapping):
        named_here = "task" in overrides
        apply_mapping(cfg, dict(overrides), source="evaluate(overrides=...)")
    else:
        overrides = list(overrides)
        named_here = any(text.split("=", 1)[0].strip() == "task" for text in overrides)
        for override in overrides:
            apply_override(cfg, override)
    named = cfg.task if named_here else None
    if task is not None:
        named = task if isinstance(task, str) else provide_task(task)
    cfg.task = checkpoint_task(recorded, named, str(path), how)
    validate(cfg)
    return cfg


class one_line_errors:
    """The user's errors (config, data, task, checkpoint) as the CLI reports them: one line, once
    per job, then ``SystemExit(2)``; any other exception passes with its traceback."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, traceback) -> Literal[False]:  # never swallows an exception
        if error is not None and isinstance(error, outcome.user_errors()):
            raise SystemExit(outcome.report_error(error)) from None
        return False
