"""The short path: a model, an optimizer and two datasets you already have, trained by hvdtrain.

    result = hvdtrain.fit_model(model, optimizer, train_set, val_set, F.cross_entropy,
                                config={"train.epochs": 10, "train.global_batch_size": 64})

``fit_model`` wraps your objects in a built-in task (``ModelTask``) and hands it to ``hvdtrain.fit``,
so everything the Task interface guarantees holds: every rank sees its share of one global sample
order per epoch (``ShardedSampler``, resumable mid-epoch), validation counts every sample once and
sums the metrics exactly over the ranks, checkpoints and bitwise resume, SIGTERM/SIGUSR1 stops
(exit 75), the watchdog, metrics.jsonl, the trackers, elastic mode. The Task interface
(docs/tasks.md) stays for what this path does not cover (your own loaders, batch augmentation,
several optimizers).

What the short path takes, and what it makes of it:

- ``model``: an ``nn.Module`` (or a function that builds one). Rank 0's parameters are broadcast.
- ``optimizer``: an optimizer over ``model.parameters()`` as a DDP script builds it, a function
  ``params -> optimizer``, a dict of ``optim.*`` settings, or None (the ``optim`` section). Its
  ``lr`` becomes ``optim.lr``, the rate as it is (not scaled by the batch), held by
  ``optim.schedule`` (``constant`` here by default; ``cosine``, ``poly``, ``step`` by name); SGD,
  Adam, AdamW and Adagrad settings are recorded as ``optim.*`` keys, so a rerun with another rate
  or momentum is refused as another run (checkpoint/identity.py).
- ``train_set``, ``val_set``: map-style datasets whose items are ``(input, target)``. hvdtrain
  adds the sampler; nothing wraps or replaces your dataset class. ``seed_per_sample=True`` when
  ``train_set`` draws random numbers (random augmentation): each sample is then loaded under its
  own seed from (seed, epoch, index), so resume is exact whatever the workers.
- ``loss``: ``loss(outputs, targets)``, a batch mean; cross-entropy when None.
- ``metrics``: name -> ``fn(outputs, targets)`` giving one value per sample (or ``(fn, "min")``
  where lower is better); each is reported as its mean over every validation sample of every
  rank. None with a cross-entropy or NLL loss: ``accuracy`` (percent). The first metric picks
  best.pt and shows in the epoch line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Union

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset

from .api import ConfigSource, FitResult, build_config, fit_config, one_line_errors
from .config import Config, ConfigError, apply_mapping, apply_override, read_config_file, resolve_config_path
from .data.loaders import Loaders, loader_kwargs
from .data.sampler import IndexedSamples, SeededSamples, ShardedSampler
from .tasks import DataEnv, Task

Metric = Union[Callable[[Any, torch.Tensor], torch.Tensor], tuple]
OptimizerSource = Union[None, torch.optim.Optimizer, Callable[..., torch.optim.Optimizer], Mapping[str, Any]]

# The short path's defaults, between hvdtrain's (an ImageNet recipe) and the user's config: what a
# DDP script does unless it says otherwise.
DEFAULTS = {
    "optim.schedule": "constant",  # a DDP script's lr= holds unless a scheduler changes it
    "optim.warmup_epochs": 0,
    "data.workers": 0,             # DataLoader's default; the samples are in the user's process
}
# Optimizers whose settings are recorded as optim.* keys (optim.name's choices).
NAMED_OPTIMIZERS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adamw",
                    torch.optim.Adagrad: "adagrad"}


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """1 per sample whose highest output is its class, else 0."""
    return (outputs.argmax(1) == targets).to(torch.float64)


def classification_loss(loss: Callable[..., torch.Tensor]) -> bool:
    """Whether ``loss`` is cross-entropy or NLL: ``accuracy`` is then the default metric."""
    return loss in (F.cross_entropy, F.nll_loss) or isinstance(loss, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss))


def percent(name: str) -> bool:
    return name == "accuracy"


def to_device(value: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Tensors (in tuples, lists and dicts too) on ``device``; floating ones in ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(device, dtype if value.is_floating_point() else None, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(item, device, dtype) for item in value)
    if isinstance(value, dict):
        return {key: to_device(item, device, dtype) for key, item in value.items()}
    return value


def check_dataset(dataset: Any, argument: str) -> None:
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise ConfigError(f"fit_model: {argument} must be a map-style dataset (__len__ and __getitem__ returning "
                          f"(input, target)), got {type(dataset).__name__}; for streams, write a Task "
                          f"(docs/tasks.md)")
    if len(dataset) == 0:
        raise ConfigError(f"fit_model: {argument} is empty")


class ModelTask(Task):
    """A task made of a user's own objects (see the module docstring); build it with ``fit_model``,
    or hand an instance to ``hvdtrain.fit`` and ``hvdtrain.evaluate``."""

    name = "fit_model"
    sum_fields = ("loss_sum", "samples")  # the instance adds one sum per metric
    metric_directions = {"loss": "min"}

    def __init__(self, model: torch.nn.Module | Callable[[], torch.nn.Module], train_set: Dataset,
                 val_set: Dataset, loss: Callable[..., torch.Tensor] | None = None,
                 metrics: Mapping[str, Metric] | None = None, optimizer: OptimizerSource = None,
                 seed_per_sample: bool = False, cfg: Config | None = None):
        super().__init__(cfg if cfg is not None else Config())
        check_dataset(train_set, "train_set")
        check_dataset(val_set, "val_set")
        self.model = model() if callable(model) and not isinstance(model, torch.nn.Module) else model
        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"fit_model: model must be a torch.nn.Module or a function returning one, got "
                              f"{type(self.model).__name__}")
        self.train_set, self.val_set, self.seed_per_sample = train_set, val_set, seed_per_sample
        self.loss_fn = loss if loss is not None else F.cross_entropy
        if metrics is None:
            metrics = {"accuracy": accuracy} if classification_loss(self.loss_fn) else {}
        self.metrics: dict[str, Callable] = {}
        directions = {"loss": "min"}
        for metric, spec in metrics.items():
            fn, direction = spec if isinstance(spec, tuple) else (spec, "max")
            if not callable(fn) or direction not in ("max", "min") or metric in ("loss", "samples"):
                raise ConfigError(f"fit_model: metric '{metric}' must be a function (outputs, targets) -> one value "
                                  f"per sample, or (function, \"max\" | \"min\"), named other than loss or samples")
            self.metrics[metric], directions[metric] = fn, direction
        self.sum_fields = ("loss_sum", *self.metrics, "samples")
        self.metric_directions = directions
        self.best_metric = next(iter(self.metrics), "loss")
        self.higher_is_better = directions[self.best_metric] == "max"
        self.optimizer, self.settings_given = self.resolve_optimizer(optimizer)

    def resolve_optimizer(self, optimizer: OptimizerSource) -> tuple[torch.optim.Optimizer | None, dict[str, Any]]:
        """(the optimizer to train with, or None for the optim section's; the optim.* settings it means)."""
        if optimizer is None:
            return None, {}
        if isinstance(optimizer, Mapping):
            return None, {(key if key.startswith("optim.") else f"optim.{key}"): value
                          for key, value in optimizer.items()}
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ConfigError(f"fit_model: optimizer must be a torch optimizer over model.parameters(), a function "
                                  f"params -> optimizer, a dict of optim.* settings, or None; got "
                                  f"{type(optimizer).__name__}")
            optimizer = optimizer(self.model.parameters())
        own = {id(param) for param in self.model.parameters()}
        if any(id(param) not in own for group in optimizer.param_groups for param in group["params"]):
            raise ConfigError("fit_model: the optimizer holds parameters that are not the model's: build it over "
                              "model.parameters() of the model handed to fit_model")
        return optimizer, optimizer_settings(optimizer)

    def build_loaders(self, env: DataEnv) -> Loaders:
        cfg, batch = self.cfg, self.cfg.train.batch_size
        train_sampler = ShardedSampler(len(self.train_set), env.world_size, env.rank, seed=cfg.seed)
        val_sampler = ShardedSampler(len(self.val_set), env.world_size, env.rank, shuffle=False, pad=False)
        kwargs = loader_kwargs(cfg.data, env.pin_memory)
        wrap = SeededSamples if self.seed_per_sample else IndexedSamples
        train = DataLoader(wrap(self.train_set), batch_size=batch, sampler=train_sampler,
                           drop_last=not env.keep_partial_batches,
                           generator=torch.Generator().manual_seed(cfg.seed), **kwargs)
        val = DataLoader(IndexedSamples(self.val_set), batch_size=batch, sampler=val_sampler, **kwargs)
        return Loaders(train, val, train_sampler, len(self.train_set), len(self.val_set), val_sampler)

    def build_model(self) -> torch.nn.Module:
        return self.model

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer | None:
        if self.optimizer is not None:
            peak = float(self.optimizer.param_groups[0]["lr"])
            for group in self.optimizer.param_groups:  # the schedule sets lr x lr_mult on every group
                group.setdefault("lr_mult", float(group["lr"]) / peak if peak else 1.0)
        return self.optimizer

    def to_device(self, batch: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            count = f" of {len(batch)}" if isinstance(batch, (tuple, list)) else ""
            raise ConfigError(f"fit_model: a dataset item must be (input, target); a batch came as "
                              f"{type(batch).__name__}{count}")
        inputs, targets = batch
        return to_device(inputs, device, dtype), to_device(targets, device, dtype)

    def loss(self, outputs: Any, targets: torch.Tensor, training: bool) -> torch.Tensor:
        return self.loss_fn(outputs, targets)

    def metric_sums(self, loss: torch.Tensor, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        count = torch.tensor(float(len(targets)), dtype=torch.float64, device=loss.device)
        sums = [loss.detach().double() * count]
        sums += [fn(outputs, targets).detach().double().sum() for fn in self.metrics.values()]
        return torch.stack([*sums, count])

    def summarize(self, sums: torch.Tensor) -> dict[str, float]:
        values = sums.tolist()
        count = values[-1] or 1.0
        result = {"loss": values[0] / count}
        for metric, total in zip(self.metrics, values[1:-1]):
            result[metric] = (100.0 if percent(metric) else 1.0) * total / count
        return {**result, "samples": int(values[-1])}

    def epoch_summary(self, train: dict[str, Any], val: dict[str, Any]) -> str:
        shown = "".join(f", val {metric} {val[metric]:.2f}{'%' if percent(metric) else ''}"
                        for metric in self.metrics if metric in val)
        return f"train loss {train['loss']:.4f} | val loss {val['loss']:.4f}{shown}"

    def describe(self, loaders: Loaders) -> str:
        parameters = sum(param.numel() for param in self.model.parameters())
        optimizer = type(self.optimizer).__name__ if self.optimizer is not None else f"optim.name={self.cfg.optim.name}"
        seeding = "seeded per sample" if self.seed_per_sample else "not seeded per sample (seed_per_sample=False)"
        return (f"{type(self.model).__name__} ({parameters:,} parameters), {optimizer}, loss "
                f"{getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}; {loaders.train_size} train / "
                f"{loaders.val_size} val samples, {seeding}; metrics: loss"
                + "".join(f", {metric}" for metric in self.metrics))

    def checkpoint_metadata(self) -> dict[str, Any]:
        return {"model_class": type(self.model).__qualname__,
                "optimizer_class": type(self.optimizer).__qualname__ if self.optimizer is not None else None}


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optim.* keys an optimizer's first group means: its rate as ``optim.lr`` always; name,
    momentum, weight decay, betas and eps for the optimizers optim.name knows."""
    group = optimizer.param_groups[0]
    settings: dict[str, Any] = {"optim.lr": float(group["lr"])}
    name = NAMED_OPTIMIZERS.get(type(optimizer))
    if name is None:
        return settings
    settings.update({"optim.name": name, "optim.weight_decay": float(group.get("weight_decay", 0.0))})
    if name == "sgd":
        settings.update({"optim.momentum": float(group["momentum"]), "optim.nesterov": bool(group["nesterov"])})
    if name in ("adam", "adamw"):
        settings.update({"optim.beta1": float(group["betas"][0]), "optim.beta2": float(group["betas"][1]),
                         "optim.eps": float(group["eps"])})
    return settings


def short_path_config(task: ModelTask, config: ConfigSource, overrides: Iterable[str]) -> Config:
    """hvdtrain's defaults < the short path's (DEFAULTS) < what the optimizer says < ``config`` <
    ``overrides``; a Config given whole is taken as it is. ``model.arch`` records the model's class,
    so that a rerun with another model is refused as another run."""
    if isinstance(config, Config):
        return build_config(config, overrides, task)
    cfg = Config()
    apply_mapping(cfg, {**DEFAULTS, "model.arch": type(task.model).__qualname__, **task.settings_given},
                  source="fit_model")
    if isinstance(config, Mapping):
        apply_mapping(cfg, dict(config), source="fit_model(config=...)")
    elif isinstance(config, (str, Path)):
        path = resolve_config_path(config)
        apply_mapping(cfg, read_config_file(path), source=str(path))
    elif config is not None:
        overrides = [*config, *overrides]
    for override in overrides:
        apply_override(cfg, override)
    return build_config(cfg, (), task)


def fit_model(model: torch.nn.Module | Callable[[], torch.nn.Module], optimizer: OptimizerSource,
              train_set: Dataset, val_set: Dataset, loss: Callable[..., torch.Tensor] | None = None, *,
              metrics: Mapping[str, Metric] | None = None, seed_per_sample: bool = False,
              config: ConfigSource = None, overrides: Iterable[str] = ()) -> FitResult:
    """Train ``model`` on ``train_set``, validating on ``val_set`` after every epoch, on the ranks of
    this job (see the module docstring). ``config`` and ``overrides`` are ``hvdtrain.fit``'s (a dict
    such as ``{"train.epochs": 10, "train.global_batch_size": 64}``, a YAML path, ``key=value``
    strings); errors end the process as ``fit`` does (one line, exit 2; 75 after a stop)."""
    with one_line_errors():
        task = ModelTask(model, train_set, val_set, loss, metrics, optimizer, seed_per_sample)
        cfg = short_path_config(task, config, overrides)
    return fit_config(cfg)
