"""The task interface: the engine asks the task, and never names images or classes.

A task is chosen by the config key ``task`` (``image_classification`` by default; ``module:Class``
or ``path/to/file.py:Class`` for a task of the user's own: tasks/registry.py). It owns what is
specific to a workload: its datasets and loaders, its model, its loss, the sums its metrics are
made of and how those sums become metrics, its part of the per-epoch line, and the model metadata
stored in checkpoints. Everything else (launch, Horovod, the optimizer step, checkpoints, resume,
preemption, the watchdog, elastic mode) is the engine's and is shared by every task.

docs/tasks.md documents the interface (enough to write a task from it alone); docs/architecture.md
follows a step through the modules.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Sequence

import torch

from ..config.keys import ConfigError
from ..config.root import Config
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
    # collectives are not allowed. A large file index travels this way (data/files/index.py).
    allgather: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Run a block on one process per host first (e.g. generating a dataset), the others after it.
    local_rank_zero_first: Callable[[], ContextManager] = contextlib.nullcontext
    # Keep the last partial batch (train.drop_last=false; elastic runs, which re-split an epoch's
    # remaining samples). A padded ShardedSampler gives every rank the same number of samples.
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
    # The task's own settings: a dataclass whose fields (typed, each with a docstring) become the
    # config section named after the task (``name``): ``recommendation.embedding_dim``,
    # ``my_task.hidden``. Set from YAML and ``key=value`` like any key, shown by --print-config,
    # recorded in config.yaml and checkpoints; a ``validate(self, cfg)`` method on it checks them
    # (one ConfigError line). None: the task has no settings of its own.
    settings_class: type | None = None
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

    @property
    def settings(self) -> Any:
        """This task's section of the config (an instance of ``settings_class``)."""
        return getattr(self.cfg, self.name)

    def build_loaders(self, env: DataEnv) -> Loaders:
        """The training and validation loaders of this rank."""
        raise NotImplementedError

    def build_model(self) -> torch.nn.Module:
        """A freshly initialized model (after ``build_loaders``, which may tell its size)."""
        raise NotImplementedError

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer | None:
        """The task's own optimizer over ``model``'s parameters (built before, or now), or None: the one
        the ``optim`` section names. hvdtrain wraps it in Horovod's DistributedOptimizer and sets each
        group's rate every step (the schedule's rate times the group's ``lr_mult``). Default: None."""
        return None

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
        """This task's part of the per-epoch line: the losses, and the validation metric that picks
        best.pt (``checkpoint.best_metric``, else ``best_metric``) where it is not the loss."""
        line = f"train loss {train['loss']:.4f} | val loss {val['loss']:.4f}"
        best = self.cfg.checkpoint.best_metric or self.best_metric
        if best != "loss" and isinstance(val.get(best), (int, float)):
            line += f", val {best} {val[best]:.4g}"
        return line

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
