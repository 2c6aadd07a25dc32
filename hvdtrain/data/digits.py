"""A small real image dataset with no download: scikit-learn's bundled UCI handwritten digits
(1,797 8x8 scans, 10 classes), written as a JPEG ImageFolder (``train/`` and ``val/``, a stratified
80/20 split) upsampled to ``size`` pixels. Used by the tests, benchmarks/small_images.py and the
docs' small-image figures; needs scikit-learn (the ``test`` extra)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image


def digits_arrays(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(train images, train labels, val images, val labels): uint8 8x8 images, stratified 80/20."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError("the digits dataset needs scikit-learn (pip install -e '.[test]')") from None
    digits = load_digits()
    images = np.round(digits.images * (255.0 / 16.0)).astype(np.uint8)
    train_x, val_x, train_y, val_y = train_test_split(images, digits.target, test_size=0.2,
                                                      stratify=digits.target, random_state=seed)
    return train_x, train_y, val_x, val_y


def write_digits(root: Path, size: int = 32, seed: int = 0, splits: tuple[str, ...] = ("train", "val")) -> Path:
    """Write ``root/{train,val}/<digit>/<n>.jpg`` (grayscale JPEG, bicubic upsampling); atomic, and
    nothing is written when ``root`` already exists."""
    root = Path(root)
    if root.is_dir():
        return root
    train_x, train_y, val_x, val_y = digits_arrays(seed)
    scratch = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    for split, images, labels in (("train", train_x, train_y), ("val", val_x, val_y)):
        if split not in splits:
            continue
        for number, (image, label) in enumerate(zip(images, labels)):
            folder = scratch / split / str(int(label))
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image, "L").resize((size, size), Image.Resampling.BICUBIC).save(
                folder / f"{number:04d}.jpg", quality=95)
    os.rename(scratch, root)
    return root
