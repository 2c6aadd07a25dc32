"""Fast image decoding: encoded bytes to an RGB uint8 array, at the smallest size the crop allows.
The crops that ask for it live in crops.py.

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

import io
import math
import warnings
from typing import Callable

import numpy as np
import simplejpeg
import torch
from PIL import Image

# ImageNet's per-channel mean and std (0..1): the device normalizes with them, and the
# augmentation policies fill with the mean pixel.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

# libjpeg-turbo decodes at n/8 of the size; factors between 1 and 2 are not faster than a full
# decode (the scaled IDCTs have no SIMD versions), so scale by 2, 4 or 8 or not at all.
MIN_DCT_FACTOR = 2.0
# data.max_image_pixels' default: Pillow's own (Image.MAX_IMAGE_PIXELS, about a 9459 x 9459 image).
DEFAULT_MAX_PIXELS = 89_478_485

Box = tuple[float, float, float, float]  # left, top, width, height in original pixels


class BadImage(Exception):
    """A file that no decoder can turn into an image."""


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


def read_file(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


Transform = Callable[[bytes], torch.Tensor]
