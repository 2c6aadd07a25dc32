"""Models by torchvision name."""

from __future__ import annotations

import torch
from torchvision import models

from .config import ConfigError, ModelConfig


def build_model(model: ModelConfig, num_classes: int) -> torch.nn.Module:
    """A freshly initialized torchvision classification model (no weights are downloaded)."""
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
