"""Progressive resizing: the training resolution of each epoch (FFCV's schedule), and how it reaches
the crops. The loader's sample wrapper (data/sampler.py SeededSamples, the shard loader) sets
RESOLUTION around each sample; crops.TrainCrop reads it (0 = the crop's own size). A context
variable rather than an argument: the crop is deep inside a task's dataset, which hvdtrain does not
build, and each loader worker process has its own.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Callable

from ...config import DataConfig

# The training resolution of the epoch being loaded (progressive resizing), set around each sample
# by sampler.SeededSamples; 0 = the crop's own size.
RESOLUTION: contextvars.ContextVar[int] = contextvars.ContextVar("hvdtrain_resolution", default=0)
# Progressive resizing's resolutions are multiples of this (FFCV).
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
