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
from typing import Any

__version__ = "0.1.0"

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
