"""The training loader over tar shards that counts the batches the trainer took (the position a
checkpoint records), and holds the next step's batches so that a shard missing for them is agreed on
by the ranks before that step (read.py says what a worker sends for it).
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any, Iterator

import torch

from ..files.bad_files import BadFile, BadFileError
from ..files.index import DataError
from ..image.folder import CountingLoader
from .read import hole_line


class ShardLoader(CountingLoader):
    """CountingLoader over a ShardStream's DataLoader that counts the batches the trainer took
    (the position a checkpoint records) and prints the stream's notes once, on rank 0.

    ``hold_ahead(ahead, count)``: the next passes read and count (bad records, holes) ``ahead``
    batches before the trainer takes them, held here, not in the position, and read at most
    ``count`` batches (engine.Epoch: one step's batches, and the batches its steps take)."""

    # The engine must not take a batch ahead (engine.DeviceBatches' prefetch): it would count here.
    counts_taken_batches = True

    def __init__(self, loader, stream: Any, fail: bool):  # stream: loader.ShardStream
        super().__init__(loader, fail)
        self.stream = stream
        self.look_ahead, self.pass_count = 0, None

    def __len__(self) -> int:
        return len(self.stream)

    def __iter__(self) -> "TakenBatches":
        for note in self.stream.notes:
            if self.stream.rank == 0:
                print(f"hvdtrain: {note}", file=sys.stderr, flush=True)
        self.stream.notes.clear()
        self.stream.batches_taken = 0
        return TakenBatches(self, self.look_ahead, self.pass_count)

    def hold_ahead(self, ahead: int, count: int | None) -> None:
        self.look_ahead, self.pass_count = ahead, count

    def note_hole(self, record: BadFile) -> None:
        """A shard a training batch needed cannot be read: counted as a sample out of replacements
        (the ranks' sum stops the run before that step); at once with data.on_bad_file=fail."""
        if self.fail:
            raise BadFileError(f"{hole_line(record)} (data.on_bad_file=fail)")
        self.tally.note([record], samples=0)


class TakenBatches:
    """One pass of a ShardLoader: ``ahead`` batches beyond the one taken are read and counted as
    soon as they can be (from the start of the pass), at most ``count`` in all; only the taken ones
    move the stream's position (``batches_taken``); a hole ends the pass there. No batch is read in a
    pass with none left (a resume at an epoch's end): the DataLoader's iterator is not even made."""

    def __init__(self, loader: ShardLoader, ahead: int, count: int | None = None):
        self.loader, self.ahead = loader, ahead
        self.budget = len(loader) if count is None else min(count, len(loader))
        self.source: Iterator | None = iter(loader.loader) if self.budget > 0 else None
        self.held: deque = deque()
        self.hole: BadFile | None = None
        self.fill()

    def __iter__(self) -> "TakenBatches":
        return self

    def fill(self) -> None:
        while self.source is not None and len(self.held) < self.ahead:
            self.pull()

    def pull(self) -> None:
        """Read until one more batch is held, the pass ends, or a hole comes."""
        while self.source is not None:
            if self.budget <= 0:
                self.source = None
                return
            try:
                images, labels, bad = next(self.source)
            except StopIteration:
                self.source = None
                return
            self.budget -= 1
            found = next((record for record in bad if getattr(record, "shard", False)), None)
            if found is not None:
                self.source, self.hole = None, found
                self.loader.note_hole(found)
                return
            batch = self.loader.accept(images, labels, bad)
            if batch is not None:
                self.held.append(batch)
                return

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.held:
            self.pull()
        if not self.held:
            if self.hole is not None:
                raise DataError(hole_line(self.hole))
            raise StopIteration
        batch = self.held.popleft()
        self.fill()
        self.loader.stream.batches_taken += 1
        return batch
