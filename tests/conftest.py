"""Shared fixtures: a tiny generated dataset. Plain helpers (``launch``, ``PROBE``, ...) are in
tests/helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# tests/image builds and runs the docker image (about 15 minutes): only `make test-image` runs it.
collect_ignore = [] if os.environ.get("HVDTRAIN_TEST_IMAGE") else ["image"]


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """4 classes x 24 training images; 21 validation images (an odd count: uneven shards)."""
    from hvdtrain.data.demo import draw, generate

    import numpy as np

    root = tmp_path_factory.mktemp("tiny_data")
    generate(root, train_per_class=24, val_per_class=5, size=40, num_classes=4)
    extra = root / "val" / "horizontal_0" / "extra.JPEG"
    draw(0, 40, np.random.default_rng(99)).save(extra, quality=90)
    return root
