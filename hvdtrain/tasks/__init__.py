"""Workloads behind one interface: the engine asks the task, and never names images or classes.

A task is chosen by the config key ``task`` (``image_classification`` by default). It owns what is
specific to a workload: its datasets and loaders, its model, its loss, the sums its metrics are
made of and how those sums become metrics, its part of the per-epoch line, and the model metadata
stored in checkpoints. Everything else (launch, Horovod, the optimizer step, checkpoints, resume,
preemption, the watchdog, elastic mode) is the engine's and is shared by every task.

See docs/architecture.md for the path of a step through the modules and how to add a task.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

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
    # Run a block on one process per host first (e.g. generating a dataset), the others after it.
    local_rank_zero_first: Callable[[], ContextManager] = contextlib.nullcontext
    # Keep the last partial batch (elastic runs re-split an epoch's remaining samples).
    keep_partial_batches: bool = False


class Task:
    """The interface a workload implements. Every method runs on every rank.

    Determinism: for exact resume, ``build_loaders`` must give every rank the same global sample
    order for an epoch from ``cfg.seed`` and the epoch (use ``data.sampler.ShardedSampler``), and any
    random augmentation must be seeded per sample (``data.sampler.SeededSamples``).

    Metrics: a rank accumulates ``metric_sums`` rows (float64, in ``sum_fields`` order); the engine
    sums them over the epoch and across ranks exactly, and ``summarize`` turns the global sums into
    metrics. Never average per-rank means: with uneven shards that is biased.
    """

    name = ""
    sum_fields: tuple[str, ...] = ()
    # The validation metric that chooses best.pt, and whether higher is better.
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

    def describe(self, loaders: Loaders) -> str:
        """The start-up line about the model and the data."""
        return f"{self.name}: {loaders.train_size} train / {loaders.val_size} val samples"

    def epoch_summary(self, train: dict[str, Any], val: dict[str, Any]) -> str:
        """This task's part of the per-epoch line."""
        return f"train loss {train['loss']:.4f} | val loss {val['loss']:.4f}"

    def checkpoint_metadata(self) -> dict[str, Any]:
        """Plain values stored in checkpoints (e.g. the number of classes), for evaluation and tools."""
        return {}


REQUIRED = ("build_loaders", "build_model", "to_device", "loss", "metric_sums", "summarize")


def task_class(name: str) -> type[Task]:
    """The class a ``task`` config value names: a registered name, or ``module:Class``."""
    target = TASKS.get(name)
    if target is None:
        if ":" not in name:
            close = difflib.get_close_matches(name, TASKS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known tasks: {', '.join(TASKS)}"
            raise ConfigError(f"config key 'task': unknown task '{name}' ({hint})")
        target = name
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"config key 'task': cannot load '{target}' ({error})") from None
    missing = [method for method in REQUIRED if getattr(cls, method, None) is getattr(Task, method)]
    if missing or not cls.sum_fields:
        what = ", ".join(missing) if missing else "sum_fields"
        raise ConfigError(f"task '{name}' lacks {what} (the task interface: docs/architecture.md)")
    return cls


def build_task(cfg: Config) -> Task:
    return task_class(cfg.task)(cfg)
