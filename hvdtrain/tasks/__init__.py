"""Workloads behind one interface: the engine asks the task, and never names images or classes.

A task is chosen by the config key ``task`` (``image_classification`` by default; ``module:Class``
or ``path/to/file.py:Class`` for a task of the user's own). It owns what is
specific to a workload: its datasets and loaders, its model, its loss, the sums its metrics are
made of and how those sums become metrics, its part of the per-epoch line, and the model metadata
stored in checkpoints. Everything else (launch, Horovod, the optimizer step, checkpoints, resume,
preemption, the watchdog, elastic mode) is the engine's and is shared by every task.

docs/tasks.md documents the interface (enough to write a task from it alone); docs/architecture.md
follows a step through the modules.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..config import TASKS, Config, ConfigError
from ..data.loaders import Loaders


@dataclass
class DataEnv:
    """What a task needs to know about the job when it builds its loaders."""

    rank: int
    world_size: int
    pin_memory: bool
    # Rank 0's value of an object, on every rank; None where collectives are not allowed (an elastic
    # worker joining a running job must not call one before the state synchronization).
    broadcast_object: Callable[[Any], Any] | None = None
    # Every rank's tensor concatenated, on every rank (the facade's ``dist.allgather``); None where
    # collectives are not allowed. A large file index travels this way (data/file_index.py).
    allgather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Run a block on one process per host first (e.g. generating a dataset), the others after it.
    local_rank_zero_first: Callable[[], ContextManager] = contextlib.nullcontext
    # Keep the last partial batch (elastic runs re-split an epoch's remaining samples).
    keep_partial_batches: bool = False
    # The training device (a task may prepare batches for it, e.g. decode images there).
    device: torch.device = torch.device("cpu")
    # Ranks on this host (their loader workers share one host's cores and memory).
    ranks_on_host: int = 1


class Task:
    """The interface a workload implements (docs/tasks.md). Every method runs on every rank.

    Determinism: for exact resume, ``build_loaders`` must give every rank the same global sample
    order for an epoch from ``cfg.seed`` and the epoch (use ``data.sampler.ShardedSampler``), and any
    random augmentation must be seeded per sample (``data.sampler.SeededSamples``).

    Metrics: a rank accumulates ``metric_sums`` rows (float64, in ``sum_fields`` order); the engine
    sums them over the epoch and across ranks exactly, and ``summarize`` turns the global sums into
    metrics. Never average per-rank means: with uneven shards that is biased.
    """

    name = ""
    sum_fields: tuple[str, ...] = ()
    # Whether each metric ``summarize`` reports is better higher ("max") or lower ("min"). best.pt,
    # ``checkpoint.best_metric`` and ``train.target`` read the direction from here, never from the
    # metric's name; a metric missing here cannot be chosen for them (one line says so).
    metric_directions: dict[str, str] = {"loss": "min"}
    # The validation metric that chooses best.pt by default. ``higher_is_better`` is its direction for
    # tasks written before ``metric_directions`` (which wins where both name it).
    best_metric = "loss"
    higher_is_better = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def build_loaders(self, env: DataEnv) -> Loaders:
        """The training and validation loaders of this rank."""
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """A freshly initialized model (after ``build_loaders``, which may tell its size)."""
        raise NotImplementedError

    def to_device(self, batch: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        """A loader's batch -> (model inputs, targets) on ``device``; floating inputs in ``dtype``."""
        raise NotImplementedError

    def augment_batch(self, inputs: Any, targets: torch.Tensor, seed: int) -> tuple[Any, torch.Tensor]:
        """Training only: a batch-level random augmentation (e.g. mixup) drawing from ``seed``, which
        the engine derives from (cfg.seed, epoch, step, pass, rank). May return soft targets that
        ``loss`` and ``metric_sums`` accept. Default: the batch as it is."""
        return inputs, targets

    def predict(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        """Evaluation outputs (e.g. averaged over test-time augmentations). Default: ``model(inputs)``."""
        return model(inputs)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, training: bool) -> torch.Tensor:
        """The mean loss of a batch (``training``: the loss that is optimized, e.g. smoothed)."""
        raise NotImplementedError

    def metric_sums(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This batch's float64 sums in ``sum_fields`` order, on the batch's device (no host sync)."""
        raise NotImplementedError

    def summarize(self, sums: torch.Tensor) -> dict[str, float]:
        """Global sums -> metrics; must include ``loss`` and ``samples``."""
        raise NotImplementedError

    def reference_metrics(self) -> dict[str, Any]:
        """Values to compare with, computed once from the data (e.g. a baseline's error on the
        validation split, the split itself): added to every validation record. Default: none."""
        return {}

    def describe(self, loaders: Loaders) -> str:
        """The start-up line about the model and the data."""
        return f"{self.name}: {loaders.train_size} train / {loaders.val_size} val samples"

    def epoch_summary(self, train: dict[str, Any], val: dict[str, Any]) -> str:
        """This task's part of the per-epoch line."""
        return f"train loss {train['loss']:.4f} | val loss {val['loss']:.4f}"

    def checkpoint_metadata(self) -> dict[str, Any]:
        """Plain values stored in checkpoints (e.g. the number of classes), for evaluation and tools."""
        return {}

    def state_components(self) -> dict[str, Any]:
        """Pieces of state the task carries through checkpoints, resume and elastic commits (objects
        with ``state_dict()`` / ``load_state_dict()``, registered on the run's state after
        ``build_loaders``), e.g. the id mapping a model's embedding rows follow."""
        return {}

    def bench_batches(self, count: int, rank: int) -> Sequence[Any]:
        """``count`` training batches of this rank for ``hvdtrain bench`` (loaded before timing)."""
        raise NotImplementedError(f"task '{self.name}' has no benchmark batches")


DIRECTIONS = ("max", "min")


def metric_directions(task: Task) -> dict[str, str]:
    """Every metric whose direction ``task`` declares: ``metric_directions``, plus ``best_metric``
    with ``higher_is_better`` where the task predates ``metric_directions``."""
    declared = {"loss": "min", task.best_metric: "max" if task.higher_is_better else "min"}
    declared.update(task.metric_directions)
    return declared


def metric_direction(task: Task, name: str, key: str) -> str:
    """"max" or "min" for the validation metric ``name`` (an ``ema_`` twin has its model's direction);
    a metric the task does not declare stops with one line that names the config ``key`` asking."""
    declared = metric_directions(task)
    direction = declared.get(name, declared.get(name.removeprefix("ema_")))
    if direction is None:
        known = ", ".join(f"{metric} ({declared[metric]})" for metric in sorted(declared))
        raise ConfigError(f"config key '{key}': task '{task.name or type(task).__name__}' does not say whether "
                          f"a higher or a lower '{name}' is better (it declares {known}); pick one of those, or "
                          f"add '{name}' to the task's metric_directions")
    return direction


REQUIRED = ("build_loaders", "build_model", "to_device", "loss", "metric_sums", "summarize")
TASKS_DOC = "docs/tasks.md"
"""The page that documents the task interface, in the hvdtrain repository."""

# Tasks handed over as Python objects (hvdtrain.fit(MyTask, ...)): the ``task`` config value that
# names them -> what builds them. Consulted before any import, so that a class defined in the
# running script (``__main__``) is used as it is, not imported a second time.
_IN_PROCESS: dict[str, Callable[[Config], Task]] = {}
_IN_PROCESS_CLASSES: dict[str, type[Task]] = {}


def is_file_target(module_part: str) -> bool:
    """``path/to/file.py`` rather than ``package.module``."""
    return module_part.endswith(".py") or "/" in module_part or os.sep in module_part


def load_file(path_text: str) -> ModuleType:
    """The module of a ``.py`` file, imported under its file name (``my_task.py`` -> ``my_task``).

    The name is stable (the same in every rank, run and loader worker) and the file's folder is
    added at the end of ``sys.path``: a DataLoader worker started with forkserver or spawn unpickles
    the task's dataset by importing its module by name, and must find the same file.
    """
    path = Path(path_text).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"config key 'task': no file {path_text} (a path is relative to the working "
                          f"directory, {Path.cwd()})")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path:
            return loaded
        where = getattr(loaded, "__file__", None) or "a built-in module"
        raise ConfigError(f"config key 'task': {path_text} would be imported as module '{name}', which is "
                          f"already {where} (rename the file)")
    if not name.isidentifier():
        raise ConfigError(f"config key 'task': {path_text}: the file name must be a Python identifier "
                          f"(rename it, e.g. to {re.sub(r'[^0-9a-zA-Z_]', '_', name)}.py)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except (ImportError, SyntaxError) as error:
        del sys.modules[name]
        raise ConfigError(f"config key 'task': cannot import {path_text} ({type(error).__name__}: "
                          f"{one_line(error)})") from None
    except BaseException:
        del sys.modules[name]
        raise
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    return module


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def task_class(name: str) -> type[Task]:
    """The class a ``task`` config value names: a registered name, ``module:Class`` or
    ``path/to/file.py:Class``; checked against the interface."""
    target = TASKS.get(name)
    if target is None:
        if ":" not in name:
            close = difflib.get_close_matches(name, TASKS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known tasks: {', '.join(TASKS)}"
            raise ConfigError(f"config key 'task': unknown task '{name}' ({hint})")
        target = name
    module_part, _, class_name = target.rpartition(":")
    if is_file_target(module_part):
        module = load_file(module_part)
    else:
        try:
            module = importlib.import_module(module_part)
        except ImportError as error:
            raise ConfigError(f"config key 'task': cannot import module '{module_part}' "
                              f"({type(error).__name__}: {one_line(error)})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        found = sorted(key for key, value in vars(module).items()
                       if isinstance(value, type) and issubclass(value, Task) and value is not Task)
        raise ConfigError(f"config key 'task': {module_part} has no class '{class_name}'"
                          + (f" (task classes there: {', '.join(found)})" if found else ""))
    check_task_class(cls, name)
    return cls


def check_task_class(cls: Any, name: str) -> None:
    """One line naming what a task class lacks, and the page that documents it."""
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ConfigError(f"task '{name}' is not a subclass of hvdtrain.Task (the task interface: {TASKS_DOC})")
    missing = [method for method in REQUIRED if getattr(cls, method) is getattr(Task, method)]
    if missing:
        raise ConfigError(f"task '{name}' lacks {', '.join(missing)} (the task interface: {TASKS_DOC})")
    if not cls.sum_fields:
        raise ConfigError(f"task '{name}' lacks sum_fields (the task interface: {TASKS_DOC})")
    wrong = {metric: way for metric, way in dict(cls.metric_directions).items() if way not in DIRECTIONS}
    if wrong:
        raise ConfigError(f"task '{name}': metric_directions takes \"max\" (higher is better) or \"min\", got "
                          f"{wrong} (the task interface: {TASKS_DOC})")


def provide(task: type[Task] | Task) -> str:
    """Make a task class or instance from the running program buildable by name; returns the
    ``task`` config value that names it.

    The name says where the class lives, so that checkpoints and config.yaml record it:
    ``module:Class``, or ``path/of/script.py:Class`` for a class defined in the script that runs
    (``__main__``). An instance is used as it is, its ``cfg`` replaced by the run's config.
    """
    cls = task if isinstance(task, type) else type(task)
    module = sys.modules.get(cls.__module__)
    script = getattr(module, "__file__", None) if cls.__module__ == "__main__" else None
    name = f"{Path(script).resolve() if script else cls.__module__}:{cls.__qualname__}"
    check_task_class(cls, name)
    _IN_PROCESS_CLASSES[name] = cls
    if isinstance(task, type):
        _IN_PROCESS[name] = task
    else:
        def same_instance(cfg: Config, instance: Task = task) -> Task:
            instance.cfg = cfg
            return instance

        _IN_PROCESS[name] = same_instance
    return name


def provided(name: str) -> bool:
    """Whether ``name`` is a task handed over by ``provide`` in this process."""
    return name in _IN_PROCESS


def checkpoint_task(recorded: str, named: str | None, checkpoint: str, how: str) -> str:
    """The ``task`` config value that evaluates a checkpoint whose config records ``recorded``.

    A checkpoint is data, and whoever hands one over must not run code as the person who evaluates
    it (Lightning's ``load_from_checkpoint`` likewise uses the class its caller names). A recorded
    task that is not built in is therefore never imported: the person running the command names
    the task (``named``: ``--task``, a ``task=`` override, a class handed to the API, or a class
    handed over in this process before, as ``fit`` does), and the recorded name must then be that
    class's or one of its bases' (the file or module may have moved). ``how`` says how to name it.
    """
    if named is None:
        if recorded in TASKS or provided(recorded):
            return recorded
        raise ConfigError(f"checkpoint '{checkpoint}' was written by task '{printable(recorded)}', which is not "
                          f"built in, and hvdtrain imports no code a checkpoint names: name the task yourself "
                          f"({how}), from code you trust")
    cls = _IN_PROCESS_CLASSES.get(named) or task_class(named)
    wanted = TASKS.get(recorded, recorded).rpartition(":")[2]
    if wanted not in {base.__qualname__ for base in cls.__mro__}:
        raise ConfigError(f"checkpoint '{checkpoint}' was written by task '{printable(recorded)}' (class "
                          f"{printable(wanted)}), but the task named here is {named} (class {cls.__qualname__}): "
                          f"name the task that wrote it, or a subclass of it")
    return named


def printable(text: str, limit: int = 200) -> str:
    """``text`` from a file (a checkpoint) fit for a one-line message: no control characters."""
    shown = re.sub(r"[^\x20-\x7e]", "?", text)
    return shown if len(shown) <= limit else shown[:limit] + "..."


def build_task(cfg: Config) -> Task:
    factory = _IN_PROCESS.get(cfg.task)
    if factory is not None:
        return factory(cfg)
    return task_class(cfg.task)(cfg)
