"""The training and validation crops, chosen from the image's size before decoding (exactly
torchvision's RandomResizedCrop and RandomHorizontalFlip draws), and the one-pass crop-resize: encoded
bytes in (decode.py), a uint8 tensor out.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from .decode import DEFAULT_MAX_PIXELS, Box, Transform, decode, decode_with_pillow, image_size
from .resolution import RESOLUTION

SCALE = (0.08, 1.0)


RATIO = (3.0 / 4.0, 4.0 / 3.0)


def crop_params(width: int, height: int, scale: tuple[float, float] = SCALE,
                ratio: tuple[float, float] = RATIO) -> tuple[int, int, int, int]:
    """``RandomResizedCrop.get_params`` for an image of this size, without the image.

    The same torch random draws in the same order as torchvision's (kept in step by a unit test),
    so the crop distribution is identical and a fixed seed gives identical crops.
    Returns (top, left, crop height, crop width).
    """
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for _ in range(10):
        target_area = area * torch.empty(1).uniform_(scale[0], scale[1]).item()
        aspect_ratio = torch.exp(torch.empty(1).uniform_(log_ratio[0], log_ratio[1])).item()
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = torch.randint(0, height - h + 1, size=(1,)).item()
            j = torch.randint(0, width - w + 1, size=(1,)).item()
            return i, j, h, w
    # Fallback to a central crop, as torchvision does.
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(width: int, height: int, resize: int, size: int) -> Box | None:
    """The region of the original image that ``Resize(resize)`` + ``CenterCrop(size)`` keeps.

    None when the center crop would need padding (resize < size): the caller falls back to the
    literal torchvision transforms.
    """
    # torchvision's Resize(int): the shorter side becomes ``resize``, the longer one is truncated.
    if width <= height:
        new_w, new_h = resize, int(resize * height / width)
    else:
        new_w, new_h = int(resize * width / height), resize
    if new_w < size or new_h < size:
        return None
    top = int(round((new_h - size) / 2.0))
    left = int(round((new_w - size) / 2.0))
    sx, sy = width / new_w, height / new_h
    return left * sx, top * sy, size * sx, size * sy


def crop_resize(array: np.ndarray, box: Box, sx: float, sy: float, size: int, flip: bool) -> torch.Tensor:
    """Crop ``box`` (original coordinates) out of the decoded array and resize it to size x size.

    Returns a uint8 CHW tensor whose memory is HWC (channels_last).
    """
    left, top, w, h = box
    x0 = min(int(round(left * sx)), array.shape[1] - 1)
    y0 = min(int(round(top * sy)), array.shape[0] - 1)
    x1 = max(x0 + 1, min(int(round((left + w) * sx)), array.shape[1]))
    y1 = max(y0 + 1, min(int(round((top + h) * sy)), array.shape[0]))
    region = torch.from_numpy(array[y0:y1, x0:x1]).permute(2, 0, 1).unsqueeze(0)
    if region.shape[-2:] == (size, size):
        out = region.contiguous(memory_format=torch.channels_last)
    else:
        # The uint8 antialiased bilinear kernel reproduces Pillow's BILINEAR resize (as used by
        # torchvision on PIL images) to within rounding, at a fraction of its cost.
        out = F.interpolate(region, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if flip:
        out = out.flip(-1)
    return out[0]


class TrainCrop:
    """RandomResizedCrop(size, scale, ratio) + RandomHorizontalFlip(hflip) from encoded bytes to a
    uint8 tensor. The flip is drawn after the crop in every case (``hflip=0`` never flips), so the
    defaults draw exactly torchvision's numbers."""

    def __init__(self, size: int, scale: tuple[float, float] = SCALE, ratio: tuple[float, float] = RATIO,
                 hflip: float = 0.5, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.size, self.scale, self.ratio, self.hflip, self.max_pixels = size, scale, ratio, hflip, max_pixels

    def plan(self, data: bytes) -> tuple[Box, int, bool, bool]:
        """The crop box (original coordinates), the output size, the flip and whether libjpeg-turbo
        reads the file: every random draw of the sample, from the header alone (the device decoder,
        data/image/device_decode.py, takes the same plan)."""
        size = RESOLUTION.get() or self.size
        width, height, turbo = image_size(data, self.max_pixels)
        top, left, h, w = crop_params(width, height, self.scale, self.ratio)
        flip = bool(torch.rand(1) < self.hflip)
        return (float(left), float(top), float(w), float(h)), size, flip, turbo

    def __call__(self, data: bytes) -> torch.Tensor:
        box, size, flip, turbo = self.plan(data)
        array, sx, sy = decode(data, box, size, turbo, self.max_pixels)
        return crop_resize(array, box, sx, sy, size, flip)


class PadCrop:
    """The small-image (CIFAR-style) crop: the image resized to size x size, zero-padded by
    ``pad`` pixels on each side, a random size x size window of that, then a flip with probability
    ``hflip``. The content is never rescaled, so a digit or a glyph keeps its size and shape."""

    def __init__(self, size: int, resize: int, pad: int, hflip: float = 0.0, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.base = CenterCrop(size, resize, max_pixels)
        self.size, self.pad, self.hflip = size, pad, hflip

    def __call__(self, data: bytes) -> torch.Tensor:
        image = self.base(data)
        # Draws: top, left, flip (one torch draw each), under the sample's seed (SeededSamples).
        top = int(torch.randint(0, 2 * self.pad + 1, size=(1,)))
        left = int(torch.randint(0, 2 * self.pad + 1, size=(1,)))
        flip = bool(torch.rand(1) < self.hflip)
        padded = F.pad(image, (self.pad,) * 4) if self.pad else image
        out = padded[:, top:top + self.size, left:left + self.size]
        return (out.flip(-1) if flip else out).contiguous()


class FlipOnly:
    """A deterministic transform (the validation crop) followed by a random horizontal flip."""

    def __init__(self, base: "Transform", hflip: float):
        self.base, self.hflip = base, hflip

    def __call__(self, data: bytes) -> torch.Tensor:
        image = self.base(data)
        return image.flip(-1).contiguous() if bool(torch.rand(1) < self.hflip) else image


# Validation resize filters (data.val_interpolation): Pillow's, antialiased as torchvision's Resize on
# PIL images.
FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}


class CenterCrop:
    """Resize(resize) + CenterCrop(size) from encoded bytes to a uint8 tensor, with Pillow's
    ``interpolation`` filter (bilinear or bicubic)."""

    def __init__(self, size: int, resize: int, max_pixels: int = DEFAULT_MAX_PIXELS, interpolation: str = "bilinear"):
        self.size, self.resize, self.max_pixels = size, resize, max_pixels
        self.interpolation = interpolation

    def __call__(self, data: bytes) -> torch.Tensor:
        width, height, turbo = image_size(data, self.max_pixels)
        box = center_crop_box(width, height, self.resize, self.size)
        if box is None:
            return self.padded(data)
        array, sx, sy = decode(data, box, self.size, turbo, self.max_pixels)
        # The center box has fractional corners; Pillow's resize takes them exactly (the torch
        # kernel would need a crop rounded to whole pixels: a half-pixel shift).
        image = Image.frombuffer("RGB", (array.shape[1], array.shape[0]), array, "raw", "RGB", 0, 1)
        left, top, w, h = box
        out = image.resize((self.size, self.size), FILTERS[self.interpolation],
                           box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy))
        return torch.from_numpy(np.asarray(out).copy()).permute(2, 0, 1)

    def padded(self, data: bytes) -> torch.Tensor:
        from torchvision import transforms

        array, _, _ = decode_with_pillow(data, (0, 0, 1, 1), self.size, self.max_pixels)
        mode = transforms.InterpolationMode(self.interpolation)
        image = transforms.CenterCrop(self.size)(transforms.Resize(self.resize, mode)(Image.fromarray(array)))
        return torch.from_numpy(np.array(image)).permute(2, 0, 1)
