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
    end_lr: float = 0.0       # cosine and poly end here
    poly_power: float = 2.0

    @classmethod
    def from_config(cls, optim: OptimConfig, global_batch: int, epochs: int, steps_per_epoch: int) -> "LRSchedule":
        peak = scaled_lr(optim.base_lr, global_batch)
        # Goyal et al. warm up from the reference rate (for 256 images) to k times it; below a global
        # batch of 256 there is nothing to warm up to, so the start never exceeds the peak.
        # optim.warmup_start >= 0 starts from that fraction of the peak instead (0: from zero).
        start = min(optim.base_lr, peak) if optim.warmup_start < 0 else optim.warmup_start * peak
        return cls(peak_lr=peak, start_lr=start, warmup_epochs=optim.warmup_epochs,
                   epochs=epochs, steps_per_epoch=steps_per_epoch, schedule=optim.schedule,
                   end_lr=optim.end_lr, poly_power=optim.poly_power)

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
    span = max(sched.epochs - sched.warmup_epochs, 1e-12)
    progress = min(max((epoch - sched.warmup_epochs) / span, 0.0), 1.0)
    if sched.schedule == "cosine":
        return sched.end_lr + (sched.peak_lr - sched.end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if sched.schedule == "poly":
        # MLPerf ResNet-50's polynomial decay after warm-up (power 2 there; power 1 is a linear decay).
        return sched.end_lr + (sched.peak_lr - sched.end_lr) * (1.0 - progress) ** sched.poly_power
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


def optimizer_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict]:
    """``param_groups`` with the classifier head in groups of its own when ``optim.head_lr_mult`` is set."""
    head = ""
    if optim.head_lr_mult != 1.0:
        from .finetune import classifier_name

        head = classifier_name(model)
    return param_groups(model, optim.weight_decay, head, optim.head_lr_mult)


def build_sgd(model: torch.nn.Module, optim: OptimConfig, lr: float) -> torch.optim.SGD:
    return torch.optim.SGD(optimizer_groups(model, optim), lr=lr, momentum=optim.momentum,
                           nesterov=optim.nesterov and optim.momentum > 0)


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names, over ``optimizer_groups`` (no weight decay on 1-d parameters).

    SGD and Adagrad also take sparse gradients (embeddings with ``sparse=True``), without weight
    decay (config.validate checks it); Adam and AdamW take dense gradients only. LARS and LAMB adapt
    the rate of the groups whose parameters are all matrices or convolutions; biases and
    normalization parameters keep the plain update (MLPerf's exclusion).
    """
    if optim.name == "sgd":
        return build_sgd(model, optim, lr)
    groups = optimizer_groups(model, optim)
    if optim.name == "adagrad":
        return torch.optim.Adagrad(groups, lr=lr)
    if optim.name == "adam":
        return torch.optim.Adam(groups, lr=lr)
    if optim.name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    from .optimizers import LAMB, LARS

    for group in groups:
        group["adapt"] = all(param.ndim > 1 for param in group["params"])
    if optim.name == "lars":
        return LARS(groups, lr=lr, momentum=optim.momentum, eta=optim.lars_eta, nesterov=optim.nesterov)
    if optim.name == "lamb":
        return LAMB(groups, lr=lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    raise ValueError(f"unknown optimizer {optim.name!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate on every group, times the group's ``lr_mult`` (the head's, optim.head_lr_mult)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
