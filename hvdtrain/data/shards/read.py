"""Reading tar shards: the records a rank wants, in order, one sequential pass per shard; and what a
loader worker sends for a shard that cannot be read.

Shards that vanish mid-run (a volume unmounted, a file deleted, EIO, a shard cut short): a shard
that cannot be opened or read stands in for each of its records still wanted (``ShardFailure``),
and reading goes on with the next shard. In validation those records are dropped and counted as
missing (``<shard>:#<record in shard>``), so a pass that loses more than ``data.max_bad_fraction``
of the split stops the run (train/bad_data.py). In training a batch cannot be made without them:
the worker sends, in that batch's place, a *hole*, an empty batch whose one record names the
shard (``BadFile(shard=True, row_end=True)``), and sends nothing after it. The ranks must stop
*before* the step that would take the hole, at the same step, and the checkpoint of that stop must
count only the batches trained on (this loader's position counts the batches the trainer took,
``counts_taken_batches``: the engine takes nothing ahead). So the loader itself holds the next
step's batches (``ShardLoader.hold_ahead``, taking.py, which engine.Epoch calls with one step's batches and the epoch's
count, never read beyond): they are read and
their records counted in the tally that the ranks sum at every step boundary (bad_data.DataGuard),
but counted in the position only when the trainer takes them. A hole among them is a sample out of
replacements in the sum, which stops every rank before that step with exit code 65, one line
naming the shard and a checkpoint that resumes exactly once the shard is back. Asked for anyway
(no guard: a benchmark), the hole is one line (DataError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from ..files.bad_files import BadFile, os_error_reason
from .manifest import IMAGE_EXTENSIONS, Split, join, open_binary
from .tar import TarError, TarReader

# A record's label: its ``.cls`` member, ASCII digits. Missing, it is NO_LABEL; not a number, BAD_LABEL;
# either way (and past the manifest's classes) the record is a bad file (loader.ShardStream.decode).
NO_LABEL, BAD_LABEL = -1, -2
MAX_LABEL_BYTES = 64


def shard_records(path: str, first: int, end: int) -> Iterator[tuple[int, str, str, bytes, int | None]]:
    """(position, key, image extension, image bytes) of records ``[first, end)`` of one shard; a
    record's label is its ``.cls`` member. Reads the file front to back, seeking over skipped records."""
    with open_binary(path) as handle:
        position, key, image, ext, label = -1, None, None, "", None
        reader = TarReader(handle)
        for name, is_file in reader:
            base = name.rsplit("/", 1)[-1]
            member_key, _, member_ext = base.partition(".")
            if member_key != key:
                if key is not None and first <= position < end:
                    yield position, key, ext, image if image is not None else b"", label
                position += 1
                if position >= end:
                    return
                key, image, ext, label = member_key, None, "", None
            if position < first or not is_file:
                continue
            if member_ext.lower() in IMAGE_EXTENSIONS:
                image, ext = reader.read(), member_ext
            elif member_ext == "cls":
                text = reader.read(MAX_LABEL_BYTES).strip()
                label = int(text) if text.isdigit() else BAD_LABEL  # the record is then a bad file, named
        if key is not None and first <= position < end:
            yield position, key, ext, image if image is not None else b"", label


@dataclass(frozen=True)
class ShardFailure:
    """A shard that could not be read (gone, unreadable, damaged, or shorter than the manifest says),
    in place of the image bytes of each of its records that were still wanted."""

    path: str
    reason: str   # one of bad_files.REASONS
    detail: str


def shard_failure(path: str, error: Exception) -> ShardFailure:
    if isinstance(error, OSError):
        return ShardFailure(path, os_error_reason(error), f"{type(error).__name__}: {error.strerror or error}")
    return ShardFailure(path, "undecodable", f"{type(error).__name__}: {error}")


def read_records(root: str, split: Split, ids: np.ndarray, wanted: set[int]
                 ) -> Iterator[tuple[int, str, bytes | ShardFailure, int]]:
    """(record id, name for messages, image bytes, label) for the ``wanted`` records among ``ids``
    (runs of consecutive records per shard, as epoch_sequence makes them), in that order. The
    wanted records of a shard that cannot be read (or ends early) come after those read from it,
    with a ShardFailure for bytes and label -1; reading goes on with the next shard."""
    if not len(ids):
        return
    shards = np.searchsorted(split.offsets, ids, side="right") - 1
    breaks = np.flatnonzero(np.diff(shards) != 0) + 1
    for run in np.split(np.arange(len(ids)), breaks):
        shard = int(shards[run[0]])
        run_ids = ids[run]
        left = [int(i) for i in run_ids if int(i) in wanted]
        if not left:
            continue  # all consumed: not even opened
        base = int(split.offsets[shard])
        first, end = int(run_ids.min()) - base, int(run_ids.max()) - base + 1
        name = join(root, split.names[shard])
        found: set[int] = set()
        failure = None
        try:
            for position, key, _, data, label in shard_records(name, first, end):
                record = base + position
                if record in wanted:
                    found.add(record)
                    yield record, f"{name}:{key}", data, NO_LABEL if label is None else label
        except (OSError, TarError) as error:
            failure = shard_failure(name, error)
        if failure is None and not found.issuperset(left):
            failure = ShardFailure(name, "undecodable", f"fewer records than the {int(split.counts[shard])} that "
                                                        f"manifest.json lists: changed since it was written?")
        if failure is not None:
            for record in dict.fromkeys(left):
                if record not in found:
                    yield record, f"{name}:#{record - base}", failure, -1


def hole(failure: ShardFailure) -> tuple[torch.Tensor, torch.Tensor, list[BadFile]]:
    """A training batch that needed a shard that cannot be read: no images, and one record naming
    the shard, which stops the run before the step that would take it (train/bad_data.py)."""
    return (torch.empty((0, 3, 1, 1), dtype=torch.uint8), torch.empty(0, dtype=torch.long),
            [BadFile(failure.path, failure.reason, failure.detail, own=True, row_end=True, shard=True)])


def hole_line(record: BadFile) -> str:
    return (f"training shard {record.path} cannot be read ({record.detail}): restore the shards (remount the "
            f"volume), then run the same command to resume")
