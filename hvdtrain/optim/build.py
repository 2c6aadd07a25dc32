"""Optimizer construction and the learning-rate schedule.

The schedule is a pure function of the optimizer step (``lr_at``), so that it can be tested
against the numbers of Goyal et al. 2017 ("Accurate, Large Minibatch SGD") and so that a resumed
run, whatever its number of ranks, lands on exactly the learning rate it would have had.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import ConfigError, OptimConfig, milestone_epochs

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
    warmup_prefix: bool = True  # False: the decay runs over the whole run (timm's warmup_prefix=False)
    lr_step: str = "step"       # step, epoch or epoch_warmup_end (optim.lr_step)
    # The step schedule: x step_gamma at each of these epochs, or every step_every_epochs epochs;
    # neither = 30, 60 and 80 of 90 epochs, scaled to ``epochs``.
    milestones: tuple[float, ...] = ()
    step_every_epochs: int = 0
    step_gamma: float = 0.1

    @classmethod
    def from_config(cls, optim: OptimConfig, global_batch: int, epochs: int, steps_per_epoch: int,
                    rank_batch: int = 0, passes: int = 1) -> "LRSchedule":
        # optim.lr is a rate as it is (a DDP script's lr=); else the per-256 rate scaled linearly, or
        # the rate of one rank's batch (``rank_batch`` per backward pass, ``passes`` a step: Horovod's
        # example's --base-lr) scaled alike.
        reference = optim.base_lr
        if optim.lr_per_rank > 0:
            if rank_batch <= 0:
                raise ValueError("optim.lr_per_rank needs the batch of one rank")
            reference = optim.lr_per_rank * REFERENCE_BATCH / rank_batch  # the same rate per 256 images
        peak = optim.lr if optim.lr > 0 else scaled_lr(reference, global_batch)
        # Goyal et al. warm up from the reference rate (for 256 images) to k times it; below a global
        # batch of 256 there is nothing to warm up to, so the start never exceeds the peak. Horovod's
        # example warms up from one rank's rate (optim.lr_per_rank x its passes).
        # optim.warmup_start >= 0 starts from that fraction of the peak instead (0: from zero).
        # optim.warmup_start_lr >= 0 is an absolute start (timm's warmup_lr).
        first = optim.lr_per_rank * passes if optim.lr_per_rank > 0 else optim.base_lr
        start = min(first, peak) if optim.warmup_start < 0 else optim.warmup_start * peak
        if optim.lr > 0 and optim.warmup_start < 0:
            start = 0.0  # an absolute rate has no reference rate to warm up from
        if optim.warmup_start_lr >= 0:
            start = optim.warmup_start_lr
        return cls(peak_lr=peak, start_lr=start, warmup_epochs=optim.warmup_epochs,
                   epochs=epochs, steps_per_epoch=steps_per_epoch, schedule=optim.schedule,
                   end_lr=optim.end_lr, poly_power=optim.poly_power, warmup_prefix=optim.warmup_prefix,
                   lr_step=optim.lr_step, milestones=milestone_epochs(optim.step_milestones),
                   step_every_epochs=optim.step_every_epochs, step_gamma=optim.step_gamma)

    def step_milestones(self) -> tuple[float, ...]:
        """The epochs at which the step schedule multiplies the rate by ``step_gamma`` (up to ``epochs``)."""
        if self.step_every_epochs:
            return tuple(float(e) for e in range(self.step_every_epochs, self.epochs, self.step_every_epochs))
        return self.milestones or tuple(self.epochs * m / 90 for m in STEP_MILESTONES_OF_90)

    def __call__(self, step: int) -> float:
        return lr_at(step, self)


def lr_at(step: int, sched: LRSchedule) -> float:
    """Learning rate for optimizer step ``step`` (0-based): changing every step, or once per epoch
    (``lr_step``: ``epoch`` takes the value at the epoch's start, as timm's epoch schedulers;
    ``epoch_warmup_end`` gives each warm-up epoch the value the warm-up reaches at its end, as NVIDIA
    DeepLearningExamples' ``base_lr * (epoch + 1) / warmup``)."""
    epoch = step / sched.steps_per_epoch
    if sched.lr_step != "step":
        epoch = float(step // sched.steps_per_epoch)
        if sched.lr_step == "epoch_warmup_end" and epoch < sched.warmup_epochs:
            epoch = min(epoch + 1, sched.warmup_epochs)
    if epoch < sched.warmup_epochs:
        return sched.start_lr + (sched.peak_lr - sched.start_lr) * epoch / sched.warmup_epochs
    if sched.schedule == "constant":
        return sched.peak_lr
    if sched.schedule == "step":
        if sched.step_every_epochs:  # StepLR: gamma ** (epoch // step_size), whatever the run's length
            passed = int(epoch // sched.step_every_epochs)
        else:
            milestones = sched.milestones or tuple(sched.epochs * m / 90 for m in STEP_MILESTONES_OF_90)
            passed = sum(epoch >= m for m in milestones)
        return sched.peak_lr * sched.step_gamma ** passed
    # The decay runs from the end of the warm-up (warmup_prefix), or over the whole run from epoch 0
    # with the warm-up in place of its first epochs (timm's default).
    decay_start = sched.warmup_epochs if sched.warmup_prefix else 0.0
    span = max(sched.epochs - decay_start, 1e-12)
    progress = min(max((epoch - decay_start) / span, 0.0), 1.0)
    if sched.schedule == "cosine":
        return sched.end_lr + (sched.peak_lr - sched.end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if sched.schedule == "poly":
        # MLPerf ResNet-50's polynomial decay after warm-up (power 2 there; power 1 is a linear decay).
        return sched.end_lr + (sched.peak_lr - sched.end_lr) * (1.0 - progress) ** sched.poly_power
    raise ValueError(f"unknown schedule {sched.schedule!r}")


def step_milestones_text(optim: OptimConfig, schedule: LRSchedule) -> str:
    """Where the step schedule steps, as the recipe line says it: 'x0.1 every 30 epochs (at 30, 60 of
    90)', 'x0.1 at epochs 30, 60, 80 (fixed)' or 'x0.1 at epochs 6.667, 13.33, 17.78 (30/60/80 of 90,
    scaled)'."""
    at = ", ".join(f"{m:.4g}" for m in schedule.step_milestones()) or "none within the run"
    factor = f"x{optim.step_gamma:g}"
    if optim.step_every_epochs:
        return f"{factor} every {optim.step_every_epochs} epochs (at {at} of {schedule.epochs})"
    if schedule.milestones:
        return f"{factor} at epochs {at} (fixed)"
    return f"{factor} at epochs {at} (30/60/80 of 90, scaled to {schedule.epochs})"


def describe_schedule(optim: OptimConfig, schedule: LRSchedule) -> str:
    """The rate in the recipe line's terms: the warm-up's first and last rates (or none: no warm-up
    epochs, or a warm-up that starts at the peak), how often the rate changes where it does (every
    step or epoch through a warm-up and a cosine or poly decay; a step schedule changes only at its
    milestones, a constant rate never), then the decay."""
    first, steps = lr_at(0, schedule), schedule.steps_per_epoch
    last_warm = lr_at(max(math.ceil(optim.warmup_epochs * steps) - 1, 0), schedule)
    decay = optim.schedule + {"step": f" {step_milestones_text(optim, schedule)}",
                              "constant": " to the end"}.get(optim.schedule, f" to {optim.end_lr:g}")
    if not optim.warmup_prefix and optim.schedule in ("cosine", "poly"):
        decay += " over the whole run (warm-up inside it)"
    warm = optim.warmup_epochs > 0 and schedule.start_lr != schedule.peak_lr
    stepping = {"step": "every step", "epoch": "once per epoch",
                "epoch_warmup_end": "once per epoch, warm-up epochs at their end value" if warm else
                "once per epoch"}[optim.lr_step]
    if not warm:
        rate = f"no warm-up: peak {schedule.peak_lr:.4g} from step 0, then {decay}"
        return rate + (f", rate changes {stepping}" if optim.schedule in ("cosine", "poly") else "")
    rate = f"warm-up {first:.4g} (step 0) -> {last_warm:.4g} (last warm-up step) -> peak {schedule.peak_lr:.4g}"
    if optim.schedule in ("cosine", "poly"):  # the rate moves all along
        return f"{rate}, rate changes {stepping}, then {decay}"
    return f"{rate}, rate changes {stepping} in the warm-up, then {decay}"


NORM_LAYERS = (torch.nn.modules.batchnorm._NormBase, torch.nn.GroupNorm, torch.nn.LayerNorm,
               torch.nn.LocalResponseNorm)


def decay_exempt(model: torch.nn.Module, rule: str = "ndim", names: str = "bn") -> set[str]:
    """The names of the parameters that get no weight decay (``optim.no_decay``): ``ndim`` = every
    1-d parameter (normalization and biases); ``norm`` = the parameters of normalization layers
    only (biases decayed); ``names`` = those whose name contains one of the comma-separated
    substrings ``names`` (FFCV and NVIDIA: ``'bn' in name``); ``none`` = no parameter (every one
    decayed, as ``SGD(model.parameters(), weight_decay=...)``). A substring that matches no parameter
    is refused in one line: a typo would otherwise decay everything."""
    if rule == "none":
        return set()
    named = dict(model.named_parameters())
    if rule == "ndim":
        return {name for name, param in named.items() if param.ndim <= 1}
    if rule == "norm":
        return {f"{module_name}.{name}" if module_name else name
                for module_name, module in model.named_modules() if isinstance(module, NORM_LAYERS)
                for name, _ in module.named_parameters(recurse=False)}
    exempt = set()
    for pattern in (part.strip() for part in names.split(",")):
        matched = {name for name in named if pattern in name}
        if not matched:
            example = next(iter(named), "")
            raise ConfigError(f"config key 'optim.no_decay_names': '{pattern}' is in no parameter name of this "
                              f"model (names look like {example})")
        exempt |= matched
    return exempt


def param_groups(model: torch.nn.Module, weight_decay: float, head: str = "",
                 head_lr_mult: float = 1.0, no_decay: str = "ndim", no_decay_names: str = "bn") -> list[dict]:
    """Weight decay except on the parameters ``decay_exempt`` names (by default every 1-d one:
    biases and normalization parameters). The first two groups are the decayed matrices and
    convolutions and the exempt vectors; decayed vectors (e.g. the fc bias under ``norm``) and
    exempt matrices form groups of their own, so that LARS and LAMB can adapt matrices only.
    Frozen parameters (``requires_grad=False``) are left out. With ``head`` (a module name) the
    head's parameters form more groups whose rate is ``head_lr_mult`` times the rest's."""
    exempt = decay_exempt(model, no_decay, no_decay_names)
    order = [(True, True), (False, False), (True, False), (False, True)]  # (decayed, matrix)
    body: dict[tuple, list] = {key: [] for key in order}
    in_head: dict[tuple, list] = {key: [] for key in order}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        key = (name not in exempt, param.ndim > 1)
        (in_head if head and (name == head or name.startswith(head + ".")) else body)[key].append(param)
    groups = [{"params": body[key], "weight_decay": weight_decay if key[0] else 0.0}
              for key in order if key in order[:2] or body[key]]
    groups += [{"params": in_head[key], "weight_decay": weight_decay if key[0] else 0.0, "lr_mult": head_lr_mult}
               for key in order if in_head[key]]
    return groups


def optimizer_groups(model: torch.nn.Module, optim: OptimConfig) -> list[dict]:
    """``param_groups`` with the classifier head in groups of its own when ``optim.head_lr_mult`` is set."""
    head = ""
    if optim.head_lr_mult != 1.0:
        from ..model.build import classifier_name

        head = classifier_name(model)
    return param_groups(model, optim.weight_decay, head, optim.head_lr_mult, optim.no_decay, optim.no_decay_names)


def describe_exemption(model: torch.nn.Module, optim: OptimConfig) -> str:
    """One line for the start-up log: the rule and what it leaves without weight decay."""
    exempt = decay_exempt(model, optim.no_decay, optim.no_decay_names)
    named = dict(model.named_parameters())
    vectors = sum(1 for name, param in named.items() if param.ndim <= 1)
    decayed_vectors = sorted(name for name, param in named.items() if param.ndim <= 1 and name not in exempt)
    if optim.no_decay == "none":
        return f"weight decay {optim.weight_decay:g} on every parameter ({len(named)} tensors, {vectors} of them 1-d)"
    rule = {"ndim": "every 1-d parameter", "norm": "normalization layers",
            "names": f"names containing {optim.no_decay_names!r}"}[optim.no_decay]
    shown = ", ".join(decayed_vectors[:3]) + (" ..." if len(decayed_vectors) > 3 else "")
    return (f"weight decay {optim.weight_decay:g} except on {rule} ({len(exempt)} tensors exempt; "
            f"{len(decayed_vectors)} of {vectors} 1-d tensors decayed{': ' + shown if shown else ''})")


def build_sgd(model: torch.nn.Module, optim: OptimConfig, lr: float) -> torch.optim.SGD:
    return torch.optim.SGD(optimizer_groups(model, optim), lr=lr, momentum=optim.momentum,
                           nesterov=optim.nesterov and optim.momentum > 0)


def build_optimizer(model: torch.nn.Module, optim: OptimConfig, lr: float) -> torch.optim.Optimizer:
    """The optimizer ``optim.name`` names, over ``optimizer_groups`` (weight decay as ``optim.no_decay`` says).

    SGD and Adagrad also take sparse gradients (embeddings with ``sparse=True``), without weight
    decay (config.validate checks it); Adam and AdamW take dense gradients only. LARS and LAMB adapt
    the rate of the groups whose parameters are all matrices or convolutions; biases and
    normalization parameters keep the plain update (MLPerf's exclusion, timm's), with weight decay
    where ``optim.no_decay`` gives them some.
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
    from .lars_lamb import LAMB, LARS

    for group in groups:
        group["adapt"] = all(param.ndim > 1 for param in group["params"])
    if optim.name == "lars":
        return LARS(groups, lr=lr, momentum=optim.momentum, eta=optim.lars_eta, nesterov=optim.nesterov,
                    momentum_correction=optim.lars_momentum_correction)
    if optim.name == "lamb":
        return LAMB(groups, lr=lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                    max_grad_norm=optim.lamb_max_grad_norm)
    raise ValueError(f"unknown optimizer {optim.name!r}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate on every group, times the group's ``lr_mult`` (the head's, optim.head_lr_mult)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
