"""Optimizer construction and the learning-rate schedule.

The schedule is a pure function of the optimizer step (``lr_at``), so that it can be tested
against the numbers of Goyal et al. 2017 ("Accurate, Large Minibatch SGD") and so that a resumed
run, whatever its number of ranks, lands on exactly the learning rate it would have had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import OptimConfig

REFERENCE_BATCH = 256
STEP_MILESTONES_OF_90 = (30, 60, 80)


def scaled_lr(base_lr: float, global_batch: int) -> float:
    """Linear scaling rule: ``base_lr`` is the rate for 256 images."""
    return base_lr * global_batch / REFERENCE_BATCH


@dataclass(frozen=True)
class LRSchedule:
    """Everything ``lr_at`` needs; ``peak_lr`` is the scaled rate reached after warm-up."""

    peak_lr: float
    start_lr: float
    warmup_epochs: float
    epochs: int
    steps_per_epoch: int
    schedule: str = "step"

    @classmethod
    def from_config(cls, optim: OptimConfig, global_batch: int, epochs: int, steps_per_epoch: int) -> "LRSchedule":
        peak = scaled_lr(optim.base_lr, global_batch)
        # Goyal et al. warm up from the reference rate (for 256 images) to k times it; below a global
        # batch of 256 there is nothing to warm up to, so the start never exceeds the peak.
        return cls(peak_lr=peak, start_lr=min(optim.base_lr, peak), warmup_epochs=optim.warmup_epochs,
                   epochs=epochs, steps_per_epoch=steps_per_epoch, schedule=optim.schedule)

    def __call__(self, step: int) -> float:
        return lr_at(step, self)


def lr_at(step: int, sched: LRSchedule) -> float:
    """Learning rate for optimizer step ``step`` (0-based), changing every step."""
    epoch = step / sched.steps_per_epoch
    if epoch < sched.warmup_epochs:
        return sched.start_lr + (sched.peak_lr - sched.start_lr) * epoch / sched.warmup_epochs
    if sched.schedule == "step":
        passed = sum(epoch >= sched.epochs * m / 90 for m in STEP_MILESTONES_OF_90)
        return sched.peak_lr * 0.1 ** passed
    if sched.schedule == "cosine":
        span = max(sched.epochs - sched.warmup_epochs, 1e-12)
        progress = min(max((epoch - sched.warmup_epochs) / span, 0.0), 1.0)
        return sched.peak_lr * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {sched.schedule!r}")


def param_groups(model: torch.nn.Module, weight_decay: float, head: str = "",
                 head_lr_mult: float = 1.0) -> list[dict]:
    """Weight decay on weights only: biases and normalization parameters (all 1-d) get none.
    Frozen parameters (``requires_grad=False``) are left out. With ``head`` (a module name) the
    head's parameters form two more groups whose rate is ``head_lr_mult`` times the rest's."""
    decay, no_decay, head_decay, head_no_decay = [], [], [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        in_head = bool(head) and (name == head or name.startswith(head + "."))
        if in_head:
            (head_no_decay if param.ndim <= 1 else head_decay).append(param)
        else:
            (no_decay if param.ndim <= 1 else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    groups += [{"params": params, "weight_decay": decay_value, "lr_mult": head_lr_mult}
               for params, decay_value in ((head_decay, weight_decay), (head_no_decay, 0.0)) if params]
    return groups


def build_sgd(model: torch.nn.Module, optim: OptimConfig, lr: float) -> torch.optim.SGD:
    head = ""
    if optim.head_lr_mult != 1.0:
        from .finetune import classifier_name

        head = classifier_name(model)
    return torch.optim.SGD(param_groups(model, optim.weight_decay, head, optim.head_lr_mult), lr=lr,
                           momentum=optim.momentum, nesterov=optim.nesterov and optim.momentum > 0)


def build_torch_optimizer(model: torch.nn.Module, optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """``optim.optimizer``: SGD (the default), Adagrad or Adam, weight decay on weights only.

    SGD and Adagrad also take sparse gradients (embeddings with ``sparse=True``), without weight
    decay (config.validate checks it); Adam takes dense gradients only.
    """
    if optim.optimizer == "sgd":
        return build_sgd(model, optim, lr)
    groups = param_groups(model, optim.weight_decay)
    if optim.optimizer == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    return torch.optim.Adam(groups, lr=lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate on every group, times the group's ``lr_mult`` (the head's, optim.head_lr_mult)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
