"""Which class a ``task`` config value names, and what its config section is.

The shipped tasks by name (``TASKS``), a task of the user's own as ``module:Class`` or
``path/to/file.py:Class``, or a class handed over in this process (``provide``, as ``fit`` does).
A checkpoint's recorded task is never imported unless it is built in or named by the caller
(``checkpoint_task``).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from ..config.keys import ConfigError
from ..config.root import CORE_SECTIONS, Config
from .base import DIRECTIONS, Task

# The tasks that ship with hvdtrain: config name -> "module:Class".
TASKS = {"image_classification": "hvdtrain.tasks.image_classification:ImageClassification",
         "recommendation": "hvdtrain.tasks.recommendation.task:Recommendation"}
# The shipped tasks' own sections: name -> (section, "module:Settings"), so that a config is built
# without importing a task (and torch, Horovod) first. Each is its class's settings_class (tested).
TASK_SETTINGS = {"recommendation": ("recommendation",
                                    "hvdtrain.tasks.recommendation.settings:RecommendationSettings")}
# The names a task's section may not take: the core sections and the root keys.
RESERVED_SECTIONS = CORE_SECTIONS


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
            hint = ("; the working folder is not on sys.path: name a file as a path, task=./file.py:Class, or "
                    "add its folder to PYTHONPATH") if isinstance(error, ModuleNotFoundError) else ""
            raise ConfigError(f"config key 'task': cannot import module '{module_part}' "
                              f"({type(error).__name__}: {one_line(error)}{hint})") from None
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
    check_settings_class(cls, name)
    wrong = {metric: way for metric, way in dict(cls.metric_directions).items() if way not in DIRECTIONS}
    if wrong:
        raise ConfigError(f"task '{name}': metric_directions takes \"max\" (higher is better) or \"min\", got "
                          f"{wrong} (the task interface: {TASKS_DOC})")


def check_settings_class(cls: type[Task], name: str) -> None:
    """A task's ``settings_class`` is a dataclass, mounted under the task's ``name``, which must be a
    section name of its own."""
    settings = cls.settings_class
    if settings is None:
        return
    if not dataclasses.is_dataclass(settings) or not isinstance(settings, type):
        raise ConfigError(f"task '{name}': settings_class must be a dataclass (its fields become the config section "
                          f"'{cls.name or '?'}'), got {settings!r} (the task interface: {TASKS_DOC})")
    if not cls.name.isidentifier() or cls.name in RESERVED_SECTIONS:
        raise ConfigError(f"task '{name}' declares settings_class, so its name is the config section of its keys: "
                          f"give the class a name that is an identifier and not one of the core sections "
                          f"({', '.join(sorted(RESERVED_SECTIONS))}), e.g. name = \"my_task\", got {cls.name!r}")


def settings_of(name: str) -> tuple[str, type | None]:
    """(section, settings dataclass) of the task a ``task`` config value names; ("", None) where it
    declares none. Imports the task's module (a name from the user's own config, or one checked by
    ``checkpoint_task``)."""
    if name in TASKS and name not in _IN_PROCESS_CLASSES:
        if name not in TASK_SETTINGS:
            return "", None
        section, target = TASK_SETTINGS[name]
        module_part, _, class_name = target.partition(":")
        return section, getattr(importlib.import_module(module_part), class_name)
    cls = _IN_PROCESS_CLASSES.get(name) or task_class(name)
    return (cls.name, cls.settings_class) if cls.settings_class is not None else ("", None)


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
