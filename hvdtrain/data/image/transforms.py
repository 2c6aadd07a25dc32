"""Image transforms: the augmentation and evaluation crops, and per-batch normalization on the device.

Images leave the loader workers as uint8 tensors (a quarter of the bytes of float32 through the
worker queues and the host-to-device copy); ``DeviceNormalizer`` converts and normalizes whole
batches on the training device.
"""

from __future__ import annotations

import math

import torch

from ...config import AugmentConfig, DataConfig, float_pair
from .crops import CenterCrop, FlipOnly, PadCrop, TrainCrop
from .decode import IMAGENET_MEAN, IMAGENET_STD, Transform
from .policies import Augmented, policy_ops


def val_image_size(data: DataConfig) -> int:
    return data.val_image_size or data.image_size


def val_resize_size(data: DataConfig, size: int = 0) -> int:
    """The resize before the center crop of ``size`` (default: the validation crop): data.val_resize,
    else floor(size / data.val_crop_fraction) as timm's transforms_factory, else round(size / 0.875)."""
    size = size or val_image_size(data)
    if data.val_crop_fraction:
        return int(math.floor(size / data.val_crop_fraction))
    return data.val_resize or int(round(size / 0.875))


def fast_train_transform(data: DataConfig, augment: AugmentConfig | None = None) -> Transform:
    """Encoded bytes -> uint8 training crop, as ``augment`` asks (decoded fast, ``data/image/decode.py``):
    random_resized = torchvision's RandomResizedCrop (at the epoch's resolution with progressive
    resizing), random_pad = the padded random crop of small images, center = the evaluation crop at
    the training size; then a flip with probability ``augment.hflip``, then ``augment``'s policy and
    random erasing (``data/image/policies.py``). Without ``data.augment``, the evaluation crop alone."""
    augment = augment or AugmentConfig()
    center = CenterCrop(data.image_size, val_resize_size(data, data.image_size), data.max_image_pixels)
    if not data.augment:
        return center
    if augment.crop == "random_resized":
        crop = TrainCrop(data.image_size, float_pair("augment.scale", augment.scale),
                         float_pair("augment.ratio", augment.ratio), augment.hflip, data.max_image_pixels)
    elif augment.crop == "random_pad":
        # The whole image at the training size (no border cut away): pair it with
        # data.val_resize=image_size so that validation sees the same framing.
        crop = PadCrop(data.image_size, data.image_size, augment.pad, augment.hflip, data.max_image_pixels)
    else:
        crop = FlipOnly(center, augment.hflip) if augment.hflip > 0 else center
    op = policy_ops(augment)
    return crop if op is None else Augmented(crop, op)


def fast_eval_transform(data: DataConfig) -> Transform:
    """Encoded bytes -> uint8 center crop (``data.val_image_size``) after a resize to ``val_resize_size``
    with the ``data.val_interpolation`` filter."""
    return CenterCrop(val_image_size(data), val_resize_size(data), data.max_image_pixels, data.val_interpolation)


class DeviceNormalizer:
    """uint8 NCHW batch -> normalized ``dtype`` batch on the device, optionally channels_last."""

    def __init__(self, device: torch.device, channels_last: bool = False, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = device, dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor(IMAGENET_MEAN, device=device, dtype=dtype).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=device, dtype=dtype).view(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.to(self.dtype).sub_(self.mean).div_(self.std)
        elif images.dtype != self.dtype:
            images = images.to(self.dtype)
        return images.contiguous(memory_format=self.memory_format)
