"""hvdtrain: a Horovod-based distributed trainer for PyTorch.

The public Python API, for a script run as ``horovodrun -np 2 python my_train.py``::

    import hvdtrain
    result = hvdtrain.fit_model(model, optimizer, train_set, val_set)  # your own objects (simple.py)
    result = hvdtrain.fit(MyTask, {"train": {"epochs": 3}})          # or a YAML path, or key=value
    metrics = hvdtrain.evaluate("runs/x/checkpoints/last.pt")

a DDP script that keeps its own loop changes its imports (hvdtrain/distributed.py)::

    import hvdtrain.distributed as dist   # init_process_group, all_reduce, save, DistributedDataParallel, ...

and what a task of your own is written against (docs/tasks.md): ``Task``, ``DataEnv``, ``Loaders``,
``ShardedSampler``, ``SeededSamples``, ``loader_kwargs``. The names load on first use: ``import hvdtrain`` stays light
(the CLI answers --help without importing torch).
"""

from __future__ import annotations

import importlib
import os as _os
import sys as _sys
from typing import Any

__version__ = "0.1.0"


def _module_run(argv: list[str]) -> str | None:
    """The module a command line runs with ``-m`` (``python -u -m hvdtrain ...`` -> hvdtrain), or None."""
    index = 1
    while index < len(argv):
        word = argv[index]
        if word == "-m":
            return argv[index + 1] if index + 1 < len(argv) else None
        if word.startswith("-m"):
            return word[2:]
        if not word.startswith("-") or word in ("-", "-c") or word.startswith("-c"):
            return None  # a script, '-' (stdin) or -c: no -m
        index += 2 if word in ("-W", "-X") else 1  # the options that take a value as the next word
    return None


def _drop_working_folder() -> None:
    """``python -m hvdtrain`` (without -P) puts the folder it was started in first on ``sys.path``, so
    a ``yaml.py`` or ``numpy/`` that another user left in a shared folder would be imported, and run,
    as the user who starts a job there. Take that entry off before hvdtrain imports anything: from
    here on, ``python -m hvdtrain`` imports as ``python -P -m hvdtrain`` and the ``hvdtrain`` console
    script do. (Only -P or the console script also keep out a planted ``hvdtrain/`` folder, found
    before this code runs: the shipped scripts and the docs use them.) Folders on PYTHONPATH stay."""
    if _sys.flags.safe_path or not _sys.path or _module_run(list(getattr(_sys, "orig_argv", []))) != __name__:
        return
    try:
        here = _os.path.realpath(_os.getcwd())
    except OSError:  # the working folder was removed
        return
    if _sys.path[0] in ("", ".") or _os.path.realpath(_sys.path[0]) == here:
        del _sys.path[0]


_drop_working_folder()

# public name -> the module that defines it
_EXPORTS = {
    "fit": "hvdtrain.api", "evaluate": "hvdtrain.api", "FitResult": "hvdtrain.api",
    "fit_model": "hvdtrain.simple", "ModelTask": "hvdtrain.simple",
    "Config": "hvdtrain.config", "ConfigError": "hvdtrain.config", "load_config": "hvdtrain.job_config",
    "Task": "hvdtrain.tasks", "DataEnv": "hvdtrain.tasks",
    "Loaders": "hvdtrain.data.loaders", "loader_kwargs": "hvdtrain.data.loaders",
    "ShardedSampler": "hvdtrain.data.sampler", "SeededSamples": "hvdtrain.data.sampler",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hvdtrain' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
