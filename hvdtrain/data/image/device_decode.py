"""JPEG decoding on the training device (``data.decoder=nvimgcodec``), for GPUs whose hosts have
too few CPU cores to decode for them.

The split of the work:

* **loader workers** (CPU) read each file and plan its sample from the JPEG header alone, with the
  very random draws of the CPU pipeline (``crops.TrainCrop.plan``: the crop box, the output size
  of the epoch, the flip), so the sampler, the seeds, exact resume, progressive resizing and the
  bad-file rules are the default path's. A file libjpeg-turbo would not read (PNG, CMYK, ...) is
  decoded there on the CPU, as before; so is a validation image too small for its center crop.
* **the training process** decodes the batch's crop regions in one call of nvImageCodec (on a GPU:
  the hardware JPEG decoder of the A100/H100 class where there is one, nvJPEG's CUDA decoder
  otherwise; on a host without a GPU its CPU backend, which is how the tests run it), then resizes
  each region with the antialiased bilinear filter, flips it, and leaves a uint8 batch on the
  device that ``transforms.DeviceNormalizer`` normalizes in the run's dtype and memory format.

A file cut short (no end-of-image marker: an interrupted copy) is decoded in its worker like any
file libjpeg-turbo would not read, so it is a bad file exactly as on the CPU path (replaced by the
next file in index order in training, dropped in validation). A JPEG whose header and end marker
are in place but whose data nvImageCodec cannot decode (corruption inside) goes to the CPU decoders
in the training process; if nothing decodes it, it is a bad file too (counted, named once, and
``data.on_bad_file=fail`` stops), and in training its slot takes the closest good image of the same
batch (the batch keeps its size, the same on every run), in validation it is dropped.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
import torch
import torch.nn.functional as F

from ...config import AugmentConfig, ConfigError, DataConfig, float_pair
from ..files.bad_files import BadFileError
from .crops import CenterCrop, TrainCrop, center_crop_box, crop_resize
from .decode import BadImage, Box, decode, image_size

INSTALL = "make setup EXTRAS=gpudecode (or pip install 'hvdtrain[gpudecode]')"
DECODERS = ("cpu", "nvimgcodec", "auto")


@dataclass
class Planned:
    """One sample for the device: the encoded bytes and where to crop, or pixels the worker decoded."""

    size: int
    data: bytes | None = None
    box: Box = (0.0, 0.0, 0.0, 0.0)          # left, top, width, height in the original image
    flip: bool = False
    pixels: torch.Tensor | None = None       # uint8 CHW, when the worker decoded the file itself
    name: str = ""                           # the file, for naming it if it does not decode


@dataclass
class EncodedBatch:
    """A loader batch whose images are still encoded (``collate`` of ``Planned`` samples)."""

    samples: list[Planned]
    replace_bad: bool                        # training: a bad file's slot takes another image of the batch
    names: list[str] = field(default_factory=list)
    on_bad: Callable[[list[str]], None] | None = None   # CountingLoader.note: count, warn once, or fail

    def __len__(self) -> int:
        return len(self.samples)


class PlanTrainCrop:
    """``TrainCrop`` for the device: the same draws, no decoding (``Planned``)."""

    def __init__(self, crop: TrainCrop):
        self.crop = crop

    def __call__(self, data: bytes) -> Planned:
        box, size, flip, turbo = self.crop.plan(data)
        if not turbo or not ends_cleanly(data):
            return Planned(size, pixels=render(data, box, size, flip, turbo, self.crop.max_pixels))
        return Planned(size, data=data, box=box, flip=flip)


class PlanCenterCrop:
    """``CenterCrop`` for the device (validation): the center box from the header."""

    def __init__(self, crop: CenterCrop, hflip: float = 0.0):
        self.crop, self.hflip = crop, hflip

    def __call__(self, data: bytes) -> Planned:
        width, height, turbo = image_size(data, self.crop.max_pixels)
        box = center_crop_box(width, height, self.crop.resize, self.crop.size)
        flip = bool(torch.rand(1) < self.hflip) if self.hflip > 0 else False
        if box is None or not turbo or not ends_cleanly(data):  # the CPU path's pixels
            pixels = self.crop(data)
            return Planned(self.crop.size, pixels=pixels.flip(-1).contiguous() if flip else pixels)
        return Planned(self.crop.size, data=data, box=box, flip=flip)


def render(data: bytes, box: Box, size: int, flip: bool, turbo: bool, max_pixels: int) -> torch.Tensor:
    """The CPU path's pixels for a planned crop (BadImage when nothing decodes it)."""
    array, sx, sy = decode(data, box, size, turbo, max_pixels)
    return crop_resize(array, box, sx, sy, size, flip)


def ends_cleanly(data: bytes) -> bool:
    """Whether the JPEG's end-of-image marker is where it belongs (in its last 1 KB: some writers
    append a few bytes). A file cut short, the usual broken file (an interrupted copy), has none:
    the worker decodes it on the CPU, where it is a bad file exactly as on the CPU path."""
    return b"\xff\xd9" in data[-1024:]


def plan_transforms(data: DataConfig, augment: AugmentConfig | None = None) -> tuple[Callable, Callable]:
    """(train, eval) planning transforms for the loader workers; a recipe whose augmentation needs
    pixels in the worker is refused in one line."""
    from .transforms import fast_eval_transform, val_resize_size

    augment = augment or AugmentConfig()
    needs_pixels = [key for key, on in (("augment.crop=random_pad", augment.crop == "random_pad"),
                                        (f"augment.policy={augment.policy}", augment.policy != "none"),
                                        ("augment.random_erase", augment.random_erase > 0)) if on]
    if needs_pixels and data.augment:
        raise ConfigError(f"data.decoder=nvimgcodec decodes on the device, after the loader workers, so it cannot "
                          f"run {', '.join(needs_pixels)} (they change pixels in the workers): set data.decoder=cpu")
    center = CenterCrop(data.image_size, val_resize_size(data, data.image_size), data.max_image_pixels)
    if not data.augment:
        train: Callable = PlanCenterCrop(center)
    elif augment.crop == "random_resized":
        train = PlanTrainCrop(TrainCrop(data.image_size, float_pair("augment.scale", augment.scale),
                                        float_pair("augment.ratio", augment.ratio), augment.hflip,
                                        data.max_image_pixels))
    else:  # center (+ flip)
        train = PlanCenterCrop(center, augment.hflip)
    evaluation = fast_eval_transform(data)
    return train, PlanCenterCrop(evaluation)


def library_problem() -> str | None:
    """Why nvImageCodec cannot be used here (one line with the fix), or None."""
    # Read when the module loads: without it, a warning per undecodable file (hvdtrain names them).
    os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
    try:
        with quiet_stderr():  # it names the codec libraries it did not find (JPEG 2000, TIFF)
            import nvidia.nvimgcodec  # noqa: F401
    except ImportError as error:
        return f"data.decoder=nvimgcodec needs nvImageCodec ({error}): {INSTALL}"
    return None


def choose(decoder: str, device: torch.device) -> str:
    """The decoder a run uses: ``auto`` is nvimgcodec on a GPU host that has the library, else cpu."""
    if decoder == "auto":
        return "nvimgcodec" if device.type == "cuda" and library_problem() is None else "cpu"
    if decoder == "nvimgcodec":
        problem = library_problem()
        if problem:
            raise ConfigError(problem)
    return decoder


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """nvImageCodec prints a paragraph per codec library it does not find (JPEG 2000, TIFF) to the
    process's stderr when a decoder is made; JPEG needs neither."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class DeviceDecoder:
    """Decodes ``EncodedBatch``es into uint8 NCHW batches on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device, max_pixels: int, threads: int = 1):
        # data.max_image_pixels is applied by the workers, from each header, as on the CPU path.
        problem = library_problem()
        if problem:
            raise ConfigError(problem)
        from nvidia import nvimgcodec

        self.codec, self.device, self.max_pixels = nvimgcodec, device, max_pixels
        with quiet_stderr():
            if device.type == "cuda":
                self.decoder = nvimgcodec.Decoder(device_id=device.index or 0, max_num_cpu_threads=threads)
            else:
                self.decoder = nvimgcodec.Decoder(device_id=nvimgcodec.NVIMGCODEC_DEVICE_CPU_ONLY,
                                                  max_num_cpu_threads=threads,
                                                  backends=[nvimgcodec.Backend(nvimgcodec.CPU_ONLY)])
        # Pixels as libjpeg-turbo gives them on the CPU path: RGB, no EXIF rotation.
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.SRGB,
                                              sample_format=nvimgcodec.I_RGB)

    def describe(self) -> str:
        where = f"{self.device}" if self.device.type == "cuda" else "the CPU backend (no GPU)"
        return f"JPEG decoding: nvImageCodec on {where}; loader workers read files and plan crops"

    def regions(self, samples: list[Planned]) -> list[torch.Tensor | None]:
        """Each encoded sample's crop region, decoded: HWC uint8 on the device (None: undecodable)."""
        codec = self.codec
        streams, slots = [], []
        for slot, sample in enumerate(samples):
            if sample.data is None:
                continue
            left, top, width, height = sample.box
            x0, y0 = int(round(left)), int(round(top))
            x1, y1 = max(x0 + 1, int(round(left + width))), max(y0 + 1, int(round(top + height)))
            try:
                stream = codec.CodeStream(sample.data)
                x1, y1 = min(x1, stream.width), min(y1, stream.height)
                streams.append(stream.get_sub_code_stream(region=codec.Region(y0, x0, y1, x1)))
                slots.append(slot)
            except Exception:  # nvImageCodec could not parse what libjpeg-turbo's header reader did
                continue
        decoded: list[torch.Tensor | None] = [None] * len(samples)
        if streams:
            # On a GPU the decoder works in the stream the caller is in (the prefetch's side stream).
            stream = torch.cuda.current_stream(self.device).cuda_stream if self.device.type == "cuda" else 0
            for slot, image in zip(slots, self.decoder.decode(streams, params=self.params, cuda_stream=stream)):
                if image is None:
                    continue
                if self.device.type == "cuda":
                    decoded[slot] = torch.as_tensor(image, device=self.device)
                else:
                    decoded[slot] = torch.from_numpy(np.asarray(image.cpu()).copy())
        return decoded

    def __call__(self, batch: EncodedBatch) -> tuple[torch.Tensor, list[int]]:
        """(uint8 NCHW images on the device, the batch positions they hold: a bad file's slot in
        training holds another position's image, in validation it is left out)."""
        samples = batch.samples
        regions = self.regions(samples)
        size = samples[0].size if samples else 1
        images: list[torch.Tensor | None] = []
        bad: list[str] = []
        for slot, (sample, region) in enumerate(zip(samples, regions)):
            if sample.pixels is not None:
                images.append(sample.pixels.to(self.device, non_blocking=True))
            elif region is not None:
                images.append(resize(region, sample.size, sample.flip))
            else:
                try:  # the header parsed, the data did not decode on the device: the CPU decides
                    images.append(render(sample.data, sample.box, sample.size, sample.flip, True,
                                         self.max_pixels).to(self.device))
                except BadImage as error:
                    name = batch.names[slot] if slot < len(batch.names) else f"sample {slot}"
                    bad.append(f"{name} ({error})")
                    images.append(None)
        if bad and batch.on_bad is not None:
            batch.on_bad(bad)
        good = [slot for slot, image in enumerate(images) if image is not None]
        positions = good
        if batch.replace_bad and len(good) < len(images):
            if not good:
                raise BadFileError(f"no image of a batch of {len(images)} decodes (the first: {bad[0]}): is the "
                                   f"dataset intact?")
            # Training keeps every batch's size: a bad slot takes the closest good image before it
            # (after it, for the first slots), the same on every run.
            positions = [slot if images[slot] is not None else max((g for g in good if g < slot), default=good[0])
                         for slot in range(len(images))]
        out = torch.empty((len(positions), 3, size, size), dtype=torch.uint8, device=self.device)
        for row, slot in enumerate(positions):
            out[row] = images[slot]
        return out, positions


def resize(region: torch.Tensor, size: int, flip: bool) -> torch.Tensor:
    """HWC uint8 region -> size x size CHW uint8, antialiased bilinear (as the CPU path), flipped."""
    image = region.permute(2, 0, 1).unsqueeze(0)
    if image.shape[-2:] != (size, size):
        image = F.interpolate(image.float(), size=(size, size), mode="bilinear", antialias=True,
                              align_corners=False).round_().clamp_(0, 255).to(torch.uint8)
    if flip:
        image = image.flip(-1)
    return image[0]
