"""Per-image augmentation policies on uint8 crops (the resolution of each epoch: resolution.py).

``augment.policy`` (TrivialAugment, RandAugment, AutoAugment) and ``augment.random_erase`` run
torchvision's ``transforms.v2`` on the uint8 crop the fast decoder made (``crops.TrainCrop``),
in the loader worker. They draw from torch's global generator, which ``sampler.SeededSamples``
seeds per sample from (seed, epoch, index): the same image gets the same augmentation wherever
and whenever it is loaded, so exact resume holds.

Random erasing fills with the mean pixel (ImageNet's mean in uint8), which is what torchvision's
reference recipe gets by erasing to 0 after normalization.

``augment.policy=timm_randaugment`` is timm's RandAugment (``timm/data/auto_augment.py``,
``rand_augment_transform``), not torchvision's: its magnitude runs from 0 to 10 (timm's
``_LEVEL_DENOM``), so timm's ``rand-m6`` is 6/10 of the strongest setting where torchvision's
``RandAugment(magnitude=6, num_magnitude_bins=31)`` is 6/30; each chosen op is applied with
probability 0.5, with its magnitude drawn from N(m, mstd) clipped to 0..10, a random sign for the
geometric and colour ops, a random bilinear or bicubic filter, and the mean pixel as fill. The
mapping from timm's notation: ``rand-m6-n2-mstd0.5-inc1`` = ``augment.policy=timm_randaugment
augment.magnitude=6 augment.num_ops=2 augment.magnitude_std=0.5 augment.increasing_ops=true``.

"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from ...config import AugmentConfig
from .decode import IMAGENET_MEAN

ImageOp = Callable[[torch.Tensor], torch.Tensor]
MEAN_PIXEL = tuple(int(round(255 * m)) for m in IMAGENET_MEAN)


def policy_ops(augment: AugmentConfig) -> ImageOp | None:
    """The configured per-image policy and random erasing as one uint8 -> uint8 op, or None."""
    from torchvision.transforms import v2

    ops: list[ImageOp] = []
    if augment.policy == "trivialaugment":
        ops.append(v2.TrivialAugmentWide(num_magnitude_bins=augment.magnitude_bins))
    elif augment.policy == "randaugment":
        ops.append(v2.RandAugment(num_ops=augment.num_ops, magnitude=augment.magnitude,
                                  num_magnitude_bins=augment.magnitude_bins))
    elif augment.policy == "autoaugment":
        ops.append(v2.AutoAugment(v2.AutoAugmentPolicy(augment.autoaugment_policy)))
    elif augment.policy == "timm_randaugment":
        ops.append(TimmRandAugment(augment.magnitude, augment.num_ops, augment.magnitude_std, augment.increasing_ops))
    if augment.random_erase > 0:
        ops.append(v2.RandomErasing(p=augment.random_erase, value=list(MEAN_PIXEL)))
    if not ops:
        return None
    return ops[0] if len(ops) == 1 else v2.Compose(ops)


# --- timm's RandAugment ----------------------------------------------------------------------------

LEVEL_DENOM = 10.0  # timm's _LEVEL_DENOM: magnitude 10 is the strongest setting
TIMM_OPS = ("AutoContrast", "Equalize", "Invert", "Rotate", "Posterize", "Solarize", "SolarizeAdd", "Color",
            "Contrast", "Brightness", "Sharpness", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel")
# inc1: the ops whose strength falls with the magnitude in the default set are replaced by increasing ones.
INCREASING = {"Posterize": "PosterizeIncreasing", "Solarize": "SolarizeIncreasing", "Color": "ColorIncreasing",
              "Contrast": "ContrastIncreasing", "Brightness": "BrightnessIncreasing",
              "Sharpness": "SharpnessIncreasing"}


def uniform() -> float:
    return float(torch.rand(()))


def negate_half(value: float) -> float:
    """timm's ``_randomly_negate``."""
    return -value if uniform() > 0.5 else value


def timm_op_argument(name: str, level: float, image_size: int) -> float:
    """timm's ``LEVEL_TO_ARG`` for a magnitude ``level`` in 0..10 (signs drawn here)."""
    fraction = level / LEVEL_DENOM
    if name == "Rotate":
        return negate_half(fraction * 30.0)
    if name in ("ShearX", "ShearY"):
        return negate_half(fraction * 0.3)
    if name in ("TranslateXRel", "TranslateYRel"):
        return negate_half(fraction * 0.45)  # timm's translate_pct
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return fraction * 1.8 + 0.1
    if name.endswith("Increasing") and not name.startswith(("Posterize", "Solarize")):
        return max(0.1, 1.0 + negate_half(fraction * 0.9))
    if name == "Posterize":
        return int(fraction * 4)
    if name == "PosterizeIncreasing":
        return 4 - int(fraction * 4)
    if name == "Solarize":
        return int(fraction * 256)
    if name == "SolarizeIncreasing":
        return 256 - int(fraction * 256)
    if name == "SolarizeAdd":
        return int(fraction * 110)
    return 0.0


def pil_affine(image: torch.Tensor, matrix: tuple[float, ...], bicubic: bool, fill: tuple[int, ...]) -> torch.Tensor:
    """Pillow's ``Image.transform(size, AFFINE, (a, b, c, d, e, f))`` on a uint8 CHW tensor: the output
    pixel centre (x, y) samples the input at (a x + b y + c, d x + e y + f); outside is ``fill``."""
    a, b, c, d, e, f = matrix
    height, width = image.shape[-2:]
    ys, xs = torch.meshgrid(torch.arange(height) + 0.5, torch.arange(width) + 0.5, indexing="ij")
    source_x, source_y = a * xs + b * ys + c, d * xs + e * ys + f
    grid = torch.stack([2 * source_x / width - 1, 2 * source_y / height - 1], dim=-1).unsqueeze(0)
    pixels = torch.cat([image.float(), torch.ones(1, height, width)]).unsqueeze(0)
    out = F.grid_sample(pixels, grid, mode="bicubic" if bicubic else "bilinear", padding_mode="zeros",
                        align_corners=False)[0]
    inside = out[-1:].clamp(0, 1)
    mixed = out[:-1] + (1 - inside) * torch.tensor(fill, dtype=torch.float32).view(-1, 1, 1)
    return mixed.round().clamp(0, 255).to(torch.uint8)


def apply_timm_op(image: torch.Tensor, name: str, argument: float, bicubic: bool) -> torch.Tensor:
    """One of timm's RandAugment ops, on a uint8 CHW tensor (torchvision's functional ops, which follow
    Pillow's ImageOps and ImageEnhance)."""
    from torchvision.transforms.v2 import functional as TF

    width, height = image.shape[-1], image.shape[-2]
    if name == "AutoContrast":
        return TF.autocontrast(image)
    if name == "Equalize":
        return TF.equalize(image)
    if name == "Invert":
        return TF.invert(image)
    if name == "Rotate":  # Pillow's Image.rotate: counter-clockwise about the centre (timm's rotate)
        angle = -math.radians(argument)
        a, b, d, e = math.cos(angle), math.sin(angle), -math.sin(angle), math.cos(angle)
        cx, cy = width / 2.0, height / 2.0
        return pil_affine(image, (a, b, a * -cx + b * -cy + cx, d, e, d * -cx + e * -cy + cy), bicubic, MEAN_PIXEL)
    if name.startswith("Posterize"):
        return image if argument >= 8 else TF.posterize(image, int(argument))
    if name.startswith("Solarize") and name != "SolarizeAdd":
        return image if argument > 255 else TF.solarize(image, int(argument))
    if name == "SolarizeAdd":
        added = (image.to(torch.int16) + int(argument)).clamp(max=255).to(torch.uint8)
        return torch.where(image < 128, added, image)
    if name.startswith("Color"):
        return TF.adjust_saturation(image, argument)
    if name.startswith("Contrast"):
        return TF.adjust_contrast(image, argument)
    if name.startswith("Brightness"):
        return TF.adjust_brightness(image, argument)
    if name.startswith("Sharpness"):
        return TF.adjust_sharpness(image, argument)
    matrix = {"ShearX": (1, argument, 0, 0, 1, 0), "ShearY": (1, 0, 0, argument, 1, 0),
              "TranslateXRel": (1, 0, argument * width, 0, 1, 0),
              "TranslateYRel": (1, 0, 0, 0, 1, argument * height)}[name]
    return pil_affine(image, matrix, bicubic, MEAN_PIXEL)


class TimmRandAugment:
    """timm's ``RandAugment`` (``rand-m{magnitude}-n{num_ops}-mstd{magnitude_std}-inc{increasing}``)
    on uint8 CHW tensors: ``num_ops`` ops drawn with replacement, each applied with probability 0.5.
    Draws come from torch's global generator, which the sampler seeds per sample."""

    def __init__(self, magnitude: float, num_ops: int = 2, magnitude_std: float = 0.0, increasing: bool = False):
        self.magnitude, self.num_ops, self.magnitude_std = magnitude, num_ops, magnitude_std
        self.ops = tuple(INCREASING.get(name, name) if increasing else name for name in TIMM_OPS)

    def describe(self) -> str:
        return (f"timm rand-m{self.magnitude:g}-n{self.num_ops}-mstd{self.magnitude_std:g}-"
                f"inc{int(self.ops != TIMM_OPS)}")

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        chosen = torch.randint(len(self.ops), (self.num_ops,)).tolist()
        for index in chosen:
            name = self.ops[index]
            if uniform() > 0.5:  # timm's AugmentOp(prob=0.5)
                continue
            level = self.magnitude
            if self.magnitude_std > 0:
                level = self.magnitude + self.magnitude_std * float(torch.randn(()))
            level = max(0.0, min(level, LEVEL_DENOM))
            bicubic = uniform() < 0.5  # timm's _RANDOM_INTERPOLATION for the geometric ops
            image = apply_timm_op(image, name, timm_op_argument(name, level, image.shape[-1]), bicubic)
        return image


def strength(augment: AugmentConfig) -> str:
    """The augmentation policy's strength for the start-up log, in the source's own terms."""
    if augment.policy == "timm_randaugment":
        return (TimmRandAugment(augment.magnitude, augment.num_ops, augment.magnitude_std,
                                augment.increasing_ops).describe()
                + f" ({augment.magnitude / LEVEL_DENOM:.0%} of the strongest: ShearX "
                  f"{0.3 * augment.magnitude / LEVEL_DENOM:.2f}, Rotate {30 * augment.magnitude / LEVEL_DENOM:g} deg)")
    if augment.policy == "randaugment":
        fraction = augment.magnitude / max(augment.magnitude_bins - 1, 1)
        return (f"torchvision RandAugment magnitude {augment.magnitude} of bins 0..{augment.magnitude_bins - 1}, "
                f"{augment.num_ops} ops ({fraction:.0%} of the strongest: ShearX {0.3 * fraction:.2f}, "
                f"Rotate {30 * fraction:g} deg)")
    if augment.policy == "none":
        return "no per-image policy"
    return augment.policy


class Augmented:
    """A crop transform followed by a policy op: encoded bytes -> augmented uint8 CHW tensor."""

    def __init__(self, crop: Callable[[bytes], torch.Tensor], op: ImageOp):
        self.crop, self.op = crop, op

    def __call__(self, data: bytes) -> torch.Tensor:
        # The policies want a plain CHW tensor; the crop's memory is HWC (channels_last), which
        # collate copies either way.
        return self.op(self.crop(data).contiguous())
