"""Fast image decoding and the training/validation crops, uint8 in and uint8 out.

The plain torchvision pipeline decodes the whole JPEG, converts it, crops, resizes with Pillow,
converts to float and normalizes, all on the loader's CPU cores. Here:

* the crop is chosen *before* decoding, from the size in the JPEG header, with exactly the random
  draws of ``torchvision.transforms.RandomResizedCrop.get_params`` and ``RandomHorizontalFlip``
  (same scale and ratio ranges, same flip probability, the same numbers for the same torch seed);
* the JPEG is decoded by libjpeg-turbo (simplejpeg) with DCT-domain downscaling by the largest
  factor that still leaves the crop at least at the output resolution (a big win for validation
  and for large images), straight into a numpy array;
* crop and resize happen in one pass (torch's uint8 antialiased bilinear kernel, which matches
  Pillow's filter), on a view of the decoded array, and the flip is done on the small output;
* the result stays uint8 (HWC memory, i.e. channels_last); the device normalizes whole batches.

Anything simplejpeg cannot read (PNG with a .JPEG name, CMYK, unusual JPEGs) goes through Pillow,
which converts every decodable image to RGB. A file Pillow cannot decode either raises
``BadImage``, and so does a file of more pixels than ``data.max_image_pixels`` (Pillow's
decompression-bomb limit by default), whichever decoder would have read it: the size comes from the
header, before anything is decoded.
"""

from __future__ import annotations

import contextvars
import io
import math
import warnings
from typing import Callable

import numpy as np
import simplejpeg
import torch
import torch.nn.functional as F
from PIL import Image

# ImageNet's per-channel mean and std (0..1): the device normalizes with them, and the
# augmentation policies fill with the mean pixel.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SCALE = (0.08, 1.0)
RATIO = (3.0 / 4.0, 4.0 / 3.0)
# libjpeg-turbo decodes at n/8 of the size; factors between 1 and 2 are not faster than a full
# decode (the scaled IDCTs have no SIMD versions), so scale by 2, 4 or 8 or not at all.
MIN_DCT_FACTOR = 2.0
# data.max_image_pixels' default: Pillow's own (Image.MAX_IMAGE_PIXELS, about a 9459 x 9459 image).
DEFAULT_MAX_PIXELS = 89_478_485

Box = tuple[float, float, float, float]  # left, top, width, height in original pixels
# The training resolution of the epoch being loaded (progressive resizing), set around each sample
# by sampler.SeededSamples; 0 = the crop's own size.
RESOLUTION: contextvars.ContextVar[int] = contextvars.ContextVar("hvdtrain_resolution", default=0)


class BadImage(Exception):
    """A file that no decoder can turn into an image."""


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


def is_jpeg(data: bytes) -> bool:
    return data[:3] == b"\xff\xd8\xff"


def image_size(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[int, int, bool]:
    """(width, height, whether libjpeg-turbo will decode it) from the header alone.

    An image of more than ``max_pixels`` pixels (0 = no limit) raises ``BadImage``: libjpeg-turbo
    applies no limit of its own, Pillow refuses it when opening it (``open_image``).
    """
    if is_jpeg(data):
        try:
            height, width, colorspace, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError:
            colorspace = ""
        if colorspace and colorspace != "CMYK":
            if max_pixels and width * height > max_pixels:
                raise BadImage(f"{width}x{height} = {width * height} pixels exceeds data.max_image_pixels={max_pixels}")
            return width, height, True
    try:
        with open_image(data, max_pixels) as image:
            return image.size[0], image.size[1], False
    except BadImage:
        raise
    except Exception as error:  # Pillow raises many types on garbage
        raise BadImage(describe(error)) from None


def open_image(data: bytes, max_pixels: int) -> Image.Image:
    """``Image.open`` under ``max_pixels`` (0 = no limit), so that Pillow refuses exactly the files
    the libjpeg-turbo path refuses: Pillow's own limit (Image.MAX_IMAGE_PIXELS, checked when it opens
    a file) is ``max_pixels`` meanwhile, and the DecompressionBombWarning it gives above it (it raises
    DecompressionBombError only above twice the limit) is an error. The global is put back after:
    with data.workers=0 this is the training process, whose other uses of Pillow keep theirs."""
    previous = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = max_pixels or None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            return Image.open(io.BytesIO(data))
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as error:
        raise BadImage(f"{describe(error)} (data.max_image_pixels={max_pixels})") from None
    finally:
        Image.MAX_IMAGE_PIXELS = previous


def describe(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def decode(data: bytes, box: Box, size: int, turbo: bool = True,
           max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[np.ndarray, float, float]:
    """Decode at the smallest DCT scale that keeps ``box`` at >= ``size`` pixels on both sides.

    Returns an RGB HWC uint8 array and the factors from original to decoded coordinates.
    ``turbo``: the header said libjpeg-turbo can decode it (see ``image_size``, which also checked
    ``max_pixels``; the Pillow fallback checks it again).
    """
    if turbo:
        try:
            height, width, _, _ = simplejpeg.decode_jpeg_header(data)
            factor = min(box[2], box[3]) / size
            kwargs = {}
            if factor >= MIN_DCT_FACTOR:
                kwargs = dict(min_width=math.ceil(width / factor), min_height=math.ceil(height / factor),
                              min_factor=MIN_DCT_FACTOR)
            array = simplejpeg.decode_jpeg(data, colorspace="RGB", **kwargs)
            return array, array.shape[1] / width, array.shape[0] / height
        except ValueError:
            pass  # strict libjpeg-turbo refused it; Pillow is more lenient and decides
    return decode_with_pillow(data, box, size, max_pixels)


def decode_with_pillow(data: bytes, box: Box, size: int,
                       max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[np.ndarray, float, float]:
    try:
        with open_image(data, max_pixels) as image:
            width, height = image.size
            factor = min(box[2], box[3]) / size
            if factor >= MIN_DCT_FACTOR and image.format == "JPEG":
                image.draft(image.mode, (math.ceil(width / factor), math.ceil(height / factor)))
            rgb = image.convert("RGB")
            array = np.array(rgb)  # writable: torch.from_numpy warns on read-only arrays
    except BadImage:
        raise
    except Exception as error:  # OSError, SyntaxError, ValueError, ...
        raise BadImage(describe(error)) from None
    return array, array.shape[1] / width, array.shape[0] / height


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
        data/device_decode.py, takes the same plan)."""
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


def read_file(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


Transform = Callable[[bytes], torch.Tensor]
