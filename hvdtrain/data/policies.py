"""Per-image augmentation policies on uint8 crops, and the resolution of each epoch.

``augment.policy`` (TrivialAugment, RandAugment, AutoAugment) and ``augment.random_erase`` run
torchvision's ``transforms.v2`` on the uint8 crop the fast decoder made (``decode.TrainCrop``),
in the loader worker. They draw from torch's global generator, which ``sampler.SeededSamples``
seeds per sample from (seed, epoch, index): the same image gets the same augmentation wherever
and whenever it is loaded, so exact resume holds.

Random erasing fills with the mean pixel (ImageNet's mean in uint8), which is what torchvision's
reference recipe gets by erasing to 0 after normalization.

``resolution_at`` is FFCV's progressive-resizing schedule, a pure function of the epoch.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..config import AugmentConfig, DataConfig
from .decode import IMAGENET_MEAN

ImageOp = Callable[[torch.Tensor], torch.Tensor]
MEAN_PIXEL = tuple(int(round(255 * m)) for m in IMAGENET_MEAN)
RESOLUTION_STEP = 32


def resolution_at(epoch: int, min_res: int, max_res: int, start_ramp: int, end_ramp: int) -> int:
    """FFCV's ``get_resolution``: ``min_res`` up to epoch ``start_ramp`` (0-based), ``max_res`` from
    ``end_ramp`` on, linear in between rounded to the nearest multiple of 32 (ties to even, as
    numpy's round)."""
    if epoch <= start_ramp:
        return min_res
    if epoch >= end_ramp:
        return max_res
    value = min_res + (max_res - min_res) * (epoch - start_ramp) / (end_ramp - start_ramp)
    return int(round(value / RESOLUTION_STEP)) * RESOLUTION_STEP


def epoch_resolution(data: DataConfig) -> Callable[[int], int] | None:
    """epoch -> training resolution when progressive resizing is on (``data.max_res``), else None."""
    if not data.max_res:
        return None
    # A partial, not a lambda: the shard reader carries it into its loader workers (pickled).
    return functools.partial(resolution_at, min_res=data.min_res, max_res=data.max_res,
                             start_ramp=data.start_ramp, end_ramp=data.end_ramp)


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
    if augment.random_erase > 0:
        ops.append(v2.RandomErasing(p=augment.random_erase, value=list(MEAN_PIXEL)))
    if not ops:
        return None
    return ops[0] if len(ops) == 1 else v2.Compose(ops)


class Augmented:
    """A crop transform followed by a policy op: encoded bytes -> augmented uint8 CHW tensor."""

    def __init__(self, crop: Callable[[bytes], torch.Tensor], op: ImageOp):
        self.crop, self.op = crop, op

    def __call__(self, data: bytes) -> torch.Tensor:
        # The policies want a plain CHW tensor; the crop's memory is HWC (channels_last), which
        # collate copies either way.
        return self.op(self.crop(data).contiguous())
