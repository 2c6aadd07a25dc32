"""Checks of the keys that recipes set (docs/recipes.md): augmentation, fine-tuning, EMA,
progressive resizing, optimizers and their schedules, the validation crop and cadence, the target;
each one line. The core sections' ranges and exclusions are config/checks.py's."""

from __future__ import annotations

from fractions import Fraction

from .keys import ConfigError
from .root import Config
from .sections import OptimConfig


def float_pair(key: str, text: str) -> tuple[float, float]:
    """A MIN,MAX config value (e.g. ``augment.scale``) -> (min, max), positive and ordered."""
    parts = text.replace(" ", "").split(",")
    try:
        low, high = (float(Fraction(part)) for part in parts)
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"config key '{key}': expected MIN,MAX (e.g. 0.08,1.0), got '{text}'") from None
    if not 0 < low <= high:
        raise ConfigError(f"config key '{key}': expected 0 < MIN <= MAX, got '{text}'")
    return low, high



def milestone_epochs(text: str) -> tuple[float, ...]:
    """``optim.step_milestones``: "30,60,80" -> (30.0, 60.0, 80.0), positive and increasing; "" -> ()."""
    if not text.strip():
        return ()
    try:
        epochs = tuple(float(Fraction(part)) for part in text.replace(" ", "").split(","))
    except (ValueError, ZeroDivisionError):
        raise ConfigError(f"config key 'optim.step_milestones': expected epochs separated by commas, e.g. 30,60,80, "
                          f"got '{text}'") from None
    if not all(epoch > 0 for epoch in epochs) or list(epochs) != sorted(set(epochs)):
        raise ConfigError(f"config key 'optim.step_milestones': expected positive epochs in increasing order, "
                          f"e.g. 30,60,80, got '{text}'")
    return epochs



def validate_step_schedule(optim: OptimConfig) -> None:
    """optim.step_every_epochs, optim.step_milestones and optim.step_gamma: the step schedule's own keys."""
    milestones = milestone_epochs(optim.step_milestones)
    if optim.step_every_epochs < 0:
        raise ConfigError(f"config key 'optim.step_every_epochs' must be >= 0 (0 = off), got {optim.step_every_epochs}")
    if optim.step_gamma <= 0:
        raise ConfigError(f"config key 'optim.step_gamma' must be positive (0.1 = a tenth), got {optim.step_gamma}")
    if milestones and optim.step_every_epochs:
        raise ConfigError(f"optim.step_every_epochs={optim.step_every_epochs} and optim.step_milestones="
                          f"{optim.step_milestones} both say when the rate steps: set one of the two")
    changed = [key for key, on in (("optim.step_every_epochs", optim.step_every_epochs),
                                   ("optim.step_milestones", milestones),
                                   ("optim.step_gamma", optim.step_gamma != 0.1)) if on]
    if changed and optim.schedule != "step":
        raise ConfigError(f"{changed[0]} is a setting of the step schedule: it needs optim.schedule=step, "
                          f"got {optim.schedule}")



def validate_finetune_and_augment(cfg: Config) -> None:
    """The keys of the augment section, data.val_fraction, data.max_bad_fraction and optim.head_lr_mult."""
    aug = cfg.augment
    float_pair("augment.scale", aug.scale)
    float_pair("augment.ratio", aug.ratio)
    if aug.pad < 0:
        raise ConfigError(f"config key 'augment.pad' must be >= 0, got {aug.pad}")
    if not 0 <= aug.hflip <= 1:
        raise ConfigError(f"config key 'augment.hflip' is a probability (0 to 1), got {aug.hflip}")
    if not 0 <= cfg.data.val_fraction < 1:
        raise ConfigError(f"config key 'data.val_fraction' must be in [0, 1), got {cfg.data.val_fraction}")
    if not 0 <= cfg.data.max_bad_fraction <= 1:
        raise ConfigError(f"config key 'data.max_bad_fraction' is a share of an epoch's files (0 to 1), "
                          f"got {cfg.data.max_bad_fraction}")
    if cfg.optim.head_lr_mult <= 0:
        raise ConfigError(f"config key 'optim.head_lr_mult' must be positive, got {cfg.optim.head_lr_mult}")



def validate_recipes(cfg: Config) -> None:
    """The keys of docs/recipes.md: EMA, augmentation, progressive resizing, optimizers, target."""
    optim, augment, data, ema = cfg.optim, cfg.augment, cfg.data, cfg.ema
    if not 0 <= optim.momentum < 1:
        raise ConfigError(f"config key 'optim.momentum' must be in [0, 1) for optim.name={optim.name}, "
                          f"got {optim.momentum}")
    for key in ("beta1", "beta2"):
        if not 0 <= getattr(optim, key) < 1:
            raise ConfigError(f"config key 'optim.{key}' must be in [0, 1), got {getattr(optim, key)}")
    for key, value in (("optim.end_lr", optim.end_lr), ("optim.lars_eta", optim.lars_eta),
                       ("optim.eps", optim.eps), ("augment.mixup_alpha", augment.mixup_alpha),
                       ("augment.cutmix_alpha", augment.cutmix_alpha), ("train.target_top1", cfg.train.target_top1),
                       ("train.target", cfg.train.target),
                       ("data.min_res", data.min_res), ("data.max_res", data.max_res),
                       ("data.start_ramp", data.start_ramp), ("data.end_ramp", data.end_ramp),
                       ("data.val_image_size", data.val_image_size)):
        if value < 0:
            raise ConfigError(f"config key '{key}' must be >= 0, got {value}")
    if optim.poly_power <= 0:
        raise ConfigError(f"config key 'optim.poly_power' must be positive, got {optim.poly_power}")
    for key in ("random_erase", "mix_prob", "switch_prob"):
        if not 0 <= getattr(augment, key) <= 1:
            raise ConfigError(f"config key 'augment.{key}' is a probability in [0, 1], got {getattr(augment, key)}")
    if not 0 <= augment.magnitude < augment.magnitude_bins or augment.num_ops < 1:
        raise ConfigError(f"config keys 'augment.magnitude' ({augment.magnitude}) must be in "
                          f"[0, augment.magnitude_bins ({augment.magnitude_bins})) and augment.num_ops "
                          f"({augment.num_ops}) >= 1")
    if not 0 <= ema.decay < 1:
        raise ConfigError(f"config key 'ema.decay' must be in [0, 1) (0 = off; e.g. 0.9998), got {ema.decay}")
    if ema.every_steps < 1 or ema.warmup_gamma <= 0 or ema.warmup_power <= 0:
        raise ConfigError("config keys 'ema.every_steps', 'ema.warmup_gamma' and 'ema.warmup_power' must be positive")
    if bool(data.min_res) != bool(data.max_res):
        raise ConfigError("progressive resizing needs both data.min_res and data.max_res (or neither)")
    if data.min_res > data.max_res:
        raise ConfigError(f"config key 'data.min_res' ({data.min_res}) must not exceed data.max_res ({data.max_res})")
    if data.max_res and data.min_res < data.max_res and data.end_ramp <= data.start_ramp:
        raise ConfigError(f"config key 'data.end_ramp' ({data.end_ramp}) must exceed data.start_ramp "
                          f"({data.start_ramp}) when data.min_res < data.max_res")
    if cfg.train.target and cfg.train.target_top1:
        raise ConfigError("train.target and train.target_top1 are both set: train.target_top1 is the old name of "
                          "train.target, keep only train.target")
    for key, name in (("checkpoint.best_metric", cfg.checkpoint.best_metric),
                      ("train.target_metric", cfg.train.target_metric)):
        if name.startswith("ema_") and not ema.decay:
            raise ConfigError(f"{key}={name} needs the EMA (set ema.decay, e.g. 0.9998)")
    if cfg.train.target_metric and not target_value(cfg):
        raise ConfigError(f"train.target_metric={cfg.train.target_metric} is set but train.target is 0 (off): "
                          "set train.target too")
    if cfg.eval.ema and not ema.decay:
        raise ConfigError("eval.ema=true needs a checkpoint trained with the EMA (ema.decay > 0)")
    validate_published_recipes(cfg)



def validate_published_recipes(cfg: Config) -> None:
    """The keys that published recipes need: warm-up start and stepping, weight-decay
    exemption, BCE, LARS/LAMB details, timm's RandAugment, validation crop and cadence."""
    optim, augment, data, evaluation = cfg.optim, cfg.augment, cfg.data, cfg.eval
    if not (optim.warmup_start_lr == -1 or optim.warmup_start_lr >= 0):
        raise ConfigError(f"config key 'optim.warmup_start_lr' is a rate >= 0, or -1 (as optim.warmup_start says), "
                          f"got {optim.warmup_start_lr}")
    if optim.warmup_start_lr >= 0 and optim.warmup_start != -1:
        raise ConfigError(f"optim.warmup_start={optim.warmup_start:g} and optim.warmup_start_lr="
                          f"{optim.warmup_start_lr:g} both say where the warm-up starts: set one of the two")
    validate_step_schedule(optim)
    names = [part.strip() for part in optim.no_decay_names.split(",")]
    if optim.no_decay == "names" and not all(names):
        raise ConfigError(f"config key 'optim.no_decay_names': expected name substrings separated by commas, "
                          f"e.g. bn, got '{optim.no_decay_names}' (weight decay on every parameter: "
                          f"optim.no_decay=none)")
    if not 0 <= optim.bce_target_threshold < 1:
        raise ConfigError(f"config key 'optim.bce_target_threshold' must be in [0, 1) (0 = soft targets), "
                          f"got {optim.bce_target_threshold}")
    if optim.bce_target_threshold and optim.loss != "bce":
        raise ConfigError("optim.bce_target_threshold needs optim.loss=bce")
    if optim.lars_momentum_correction and optim.name != "lars":
        raise ConfigError(f"optim.lars_momentum_correction=true needs optim.name=lars, got {optim.name}")
    if optim.lamb_max_grad_norm < 0 or (optim.lamb_max_grad_norm and optim.name != "lamb"):
        raise ConfigError(f"config key 'optim.lamb_max_grad_norm' is >= 0 and needs optim.name=lamb "
                          f"(got {optim.lamb_max_grad_norm:g} with optim.name={optim.name})")
    if cfg.model.head_init_std < 0:
        raise ConfigError(f"config key 'model.head_init_std' must be >= 0, got {cfg.model.head_init_std}")
    if augment.policy == "timm_randaugment" and not 0 <= augment.magnitude <= 10:
        raise ConfigError(f"config key 'augment.magnitude' is on timm's 0-10 scale with augment.policy="
                          f"timm_randaugment, got {augment.magnitude}")
    if augment.magnitude_std < 0:
        raise ConfigError(f"config key 'augment.magnitude_std' must be >= 0, got {augment.magnitude_std}")
    if (augment.magnitude_std or augment.increasing_ops) and augment.policy != "timm_randaugment":
        raise ConfigError(f"augment.magnitude_std and augment.increasing_ops are timm's RandAugment options: "
                          f"they need augment.policy=timm_randaugment, got {augment.policy}")
    if not 0 <= data.val_crop_fraction <= 1:
        raise ConfigError(f"config key 'data.val_crop_fraction' must be in (0, 1] (0 = off), "
                          f"got {data.val_crop_fraction}")
    if data.val_crop_fraction and data.val_resize:
        raise ConfigError(f"data.val_crop_fraction={data.val_crop_fraction:g} and data.val_resize="
                          f"{data.val_resize} both set the validation resize: set one of the two")
    if data.val_interpolation != "bilinear" and data.decoder == "nvimgcodec":
        raise ConfigError(f"data.val_interpolation={data.val_interpolation} needs the CPU decoder: "
                          "set data.decoder=cpu (or auto)")
    if evaluation.every_epochs < 1 or not 0 <= evaluation.offset_epochs < evaluation.every_epochs:
        raise ConfigError(f"config keys 'eval.every_epochs' ({evaluation.every_epochs}) must be >= 1 and "
                          f"eval.offset_epochs ({evaluation.offset_epochs}) in [0, eval.every_epochs)")



def target_value(cfg: Config) -> float:
    """``train.target``, or its old name ``train.target_top1``; 0 = no target."""
    return cfg.train.target or cfg.train.target_top1
