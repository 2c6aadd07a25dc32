"""Models by torchvision name, or timm's (``model.arch=timm/<name>``, the optional ``timm`` extra)."""

from __future__ import annotations

import difflib

import torch
from torchvision import models

from .config import ConfigError, ModelConfig


TIMM_PREFIX = "timm/"
TIMM_MISSING = "timm is not installed (pip install -e '.[timm]', or make setup EXTRAS=timm)"


def import_timm(arch: str):
    try:
        import timm
    except ImportError:
        raise ConfigError(f"config key 'model.arch': {arch} needs {TIMM_MISSING}") from None
    return timm


def build_timm_model(arch: str, num_classes: int) -> torch.nn.Module:
    timm = import_timm(arch)
    name = arch[len(TIMM_PREFIX):]
    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=5)
        raise ConfigError(f"config key 'model.arch': unknown timm model '{name}' "
                          f"({'did you mean ' + ', '.join(close) if close else 'see timm.list_models()'})")
    # pretrained=False: timm would download from the Hugging Face hub; model.weights loads a file.
    return timm.create_model(name, pretrained=False, num_classes=num_classes)


def build_model(model: ModelConfig, num_classes: int) -> torch.nn.Module:
    """A freshly initialized classification model (no weights are downloaded; see finetune.py)."""
    if model.arch.startswith(TIMM_PREFIX):
        return build_timm_model(model.arch, num_classes)
    available = models.list_models(module=models)
    if model.arch not in available:
        close = [name for name in available if name.startswith(model.arch[:4])][:8] or available[:8]
        raise ConfigError(f"config key 'model.arch': unknown torchvision model '{model.arch}' "
                          f"(for example: {', '.join(close)})")
    return models.get_model(model.arch, weights=None, num_classes=num_classes)


def unwrap_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict without wrapper prefixes (``module.``, ``_orig_mod.``), on the CPU."""
    state = module.state_dict()
    cleaned = {}
    for key, value in state.items():
        for prefix in ("module.", "_orig_mod."):
            while key.startswith(prefix):
                key = key[len(prefix):]
        cleaned[key] = value.detach().cpu()
    return cleaned
