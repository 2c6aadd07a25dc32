"""The built-in demo dataset: a small, learnable JPEG ImageFolder generated on first use.

Ten classes, each a colour and a stripe orientation, drawn with random stripe period, phase,
background, brightness and noise, so that a model has to learn colour and orientation, and the
standard ImageNet augmentations (random-resized crop, horizontal flip) keep every class
recognizable. Nothing is downloaded.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from ..ownership import own_folder

VERSION = "stripes-v1"
PALETTE = ((220, 40, 40), (40, 200, 60), (50, 80, 230), (230, 210, 40), (200, 60, 210))
ORIENTATIONS = ("horizontal", "vertical")


def cache_root() -> Path:
    base = os.environ.get("HVDTRAIN_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hvdtrain")
    return Path(base)


def class_names() -> list[str]:
    return [f"{orientation}_{index}" for orientation in ORIENTATIONS for index in range(len(PALETTE))]


def draw(class_index: int, size: int, rng: np.random.Generator) -> Image.Image:
    colour = np.array(PALETTE[class_index % len(PALETTE)], dtype=np.float32)
    vertical = class_index // len(PALETTE) == 1
    period = rng.uniform(5.0, 12.0)
    phase = rng.uniform(0, 2 * np.pi)
    coords = np.arange(size, dtype=np.float32)
    wave = (np.sin(2 * np.pi * coords / period + phase) > 0).astype(np.float32)
    stripes = np.tile(wave[None, :], (size, 1)) if vertical else np.tile(wave[:, None], (1, size))
    background = rng.uniform(0, 90, size=3).astype(np.float32)
    brightness = rng.uniform(0.6, 1.0)
    image = background + stripes[..., None] * (colour * brightness - background)
    image += rng.normal(0, 18, size=image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8), "RGB")


def generate(root: Path, train_per_class: int, val_per_class: int, size: int, seed: int = 0,
             num_classes: int = 10) -> None:
    """Write ``root/{train,val}/<class>/*.JPEG`` for the first ``num_classes`` classes."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for class_index, name in enumerate(class_names()[:num_classes]):
            folder = root / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                draw(class_index, size, rng).save(folder / f"{name}_{i:04d}.JPEG", quality=90)


def ensure_demo_dataset(train_per_class: int = 100, val_per_class: int = 20, size: int = 72,
                        root: Path | None = None) -> Path:
    """Return the dataset folder, generating it once; safe when several processes race."""
    root = root or cache_root() / "datasets" / f"{VERSION}-{train_per_class}-{val_per_class}-{size}"
    # Under the user's cache (0700, made so if missing): a folder another user owns or can write is
    # refused in one line (hvdtrain/ownership.py), never trained on.
    own_folder(root.parent, what="dataset cache folder", fix="set HVDTRAIN_CACHE to a folder of yours")
    if (root / "val").is_dir():
        return root
    scratch = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    generate(scratch, train_per_class, val_per_class, size)
    try:
        os.rename(scratch, root)
    except OSError:  # another process finished first; its copy is identical
        shutil.rmtree(scratch, ignore_errors=True)
    return root
