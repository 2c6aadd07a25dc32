"""Models by torchvision name, or timm's (``model.arch=timm/<name>``, the optional ``timm`` extra)."""

from __future__ import annotations

import difflib

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig

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
    """A freshly initialized classification model (no weights are downloaded; see model/finetune.py), with
    the initialization and BlurPool the ``model`` section asks for (``apply_recipe``)."""
    if model.arch.startswith(TIMM_PREFIX):
        return apply_recipe(build_timm_model(model.arch, num_classes), model)
    # Imported here: a task of one's own needs no torchvision, which costs 0.3-1 s at each rank's start.
    from torchvision import models

    available = models.list_models(module=models)
    if model.arch not in available:
        close = [name for name in available if name.startswith(model.arch[:4])][:8] or available[:8]
        raise ConfigError(f"config key 'model.arch': unknown torchvision model '{model.arch}' "
                          f"(for example: {', '.join(close)})")
    return apply_recipe(models.get_model(model.arch, weights=None, num_classes=num_classes), model)


# --- initialization and BlurPool of published recipes (docs/recipes.md) ------------------------

def apply_recipe(module: nn.Module, model: ModelConfig) -> nn.Module:
    """``model.conv_init``, ``model.zero_init_residual``, ``model.head_init_std`` and ``model.blurpool``,
    in that order, on a freshly built model (the draws come from torch's generator, seeded by setup)."""
    if model.conv_init != "default":
        for layer in module.modules():
            if isinstance(layer, nn.Conv2d):
                nn.init.kaiming_normal_(layer.weight, mode=model.conv_init, nonlinearity="relu")
    if model.zero_init_residual:
        zero_last_norms(module, model.arch)
    if model.head_init_std > 0:
        head = module.get_submodule(classifier_name(module))
        nn.init.normal_(head.get_parameter("weight"), 0.0, model.head_init_std)
        if head.bias is not None:
            nn.init.zeros_(head.get_parameter("bias"))
    if model.blurpool:
        if not add_blurpool(module):
            raise ConfigError(f"model.blurpool=true: {model.arch} has no convolution with stride > 1 and at least "
                              "16 input channels")
    return module


# The last normalization of each residual block: torchvision's and timm's ResNet blocks.
LAST_NORM = {"Bottleneck": "bn3", "BasicBlock": "bn2"}


def zero_last_norms(module: nn.Module, arch: str) -> int:
    """gamma = 0 in the last BatchNorm of every residual block (torchvision's ``zero_init_residual``,
    timm's ``zero_init_last``): each block starts as the identity. Returns the number of blocks."""
    count = 0
    for block in module.modules():
        norm = getattr(block, LAST_NORM.get(type(block).__name__, ""), None)
        if isinstance(norm, nn.modules.batchnorm._BatchNorm) and norm.weight is not None:
            nn.init.zeros_(norm.weight)
            count += 1
    if not count:
        raise ConfigError(f"model.zero_init_residual=true needs ResNet blocks (Bottleneck, BasicBlock); "
                          f"{arch} has none")
    return count


class BlurPoolConv2d(nn.Module):
    """FFCV's ``BlurPoolConv2d`` (libffcv/ffcv-imagenet, train_imagenet.py): a fixed depthwise
    [1 2 1] x [1 2 1] / 16 blur at stride 1 before the wrapped strided convolution (Zhang 2019,
    "Making convolutional networks shift-invariant again"). The filter is a non-persistent buffer:
    state dicts hold the convolution only (under ``<name>.conv``)."""

    blur_filter: torch.Tensor  # the buffer registered in __init__

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv = conv
        kernel = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]) / 16.0
        self.register_buffer("blur_filter", kernel.expand(conv.in_channels, 1, 3, 3).clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blurred = F.conv2d(x, self.blur_filter.to(x.dtype), stride=1, padding=1, groups=self.conv.in_channels)
        return self.conv(blurred)


def add_blurpool(module: nn.Module) -> int:
    """Wrap every ``nn.Conv2d`` with stride > 1 and at least 16 input channels in ``BlurPoolConv2d``
    (FFCV's ``apply_blurpool`` rule); returns how many were wrapped."""
    count = 0
    for name, child in module.named_children():
        if isinstance(child, nn.Conv2d) and max(child.stride) > 1 and child.in_channels >= 16:
            setattr(module, name, BlurPoolConv2d(child))
            count += 1
        else:
            count += add_blurpool(child)
    return count


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


def classifier_name(model: nn.Module) -> str:
    """The name of the module that produces the logits: timm's ``get_classifier()``, else the last
    ``nn.Linear`` (torchvision: ``fc``, ``classifier.1``, ``heads.head``...), else the last
    convolution (squeezenet's 1x1 classifier)."""
    get_classifier = getattr(model, "get_classifier", None)
    if callable(get_classifier):
        head = get_classifier()
        for name, module in model.named_modules():
            if module is head and name:
                return name
    last_linear = last_conv = ""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            last_linear = name
        elif isinstance(module, nn.Conv2d):
            last_conv = name
    return last_linear or last_conv
