"""An image-file dataset that survives the files real datasets contain, and its loader.

A file no decoder can read (truncated, empty, not an image) never stops training by default:

* training: the sample is replaced by the next decodable file in index order (deterministic), so
  every batch keeps its size and every rank runs exactly the same number of steps;
* validation: the sample is dropped from its batch (no image is counted twice; the exact metrics
  cover the decodable images).

A file that fails is missing, unreadable or undecodable (data/files/bad_files.py). The first few are
named in a warning by each rank; each epoch counts its distinct failed files (a sample's own file,
not the replacement candidates tried for it) over every rank, per reason, into the epoch metrics
(``bad_files``); the trainer stops a run whose share passes ``data.max_bad_fraction``
(train/bad_data.py). With ``data.on_bad_file=fail`` the first bad file stops the run with one line naming it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ..files.bad_files import WARN_FILES, BadFile, BadFileError, EpochTally, as_bad_file, os_error_reason
from .decode import BadImage, Transform, read_file

# A long run of undecodable files in index order means the data, not a few files, is broken.
MAX_REPLACEMENTS = 64


class FileFailure(Exception):
    """A file that gave no image, and why (one of bad_files.REASONS)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class ImageFiles(Dataset):
    """(uint8 CHW image or None, label, [BadFile records]) per index.

    ``paths`` and ``labels``: the file index's compact arrays (data/files/file_list.py), which a loader
    worker maps instead of unpickling a copy, or plain lists."""

    def __init__(self, split_dir: Path, paths: Sequence[str], labels: Sequence[int], transform: Transform,
                 replace_bad: bool):
        self.split_dir = str(split_dir)
        self.paths = paths
        self.labels = labels
        self.transform = transform
        self.replace_bad = replace_bad

    def __len__(self) -> int:
        return len(self.paths)

    def load(self, index: int) -> torch.Tensor:
        path = f"{self.split_dir}/{self.paths[index]}"
        try:
            data = read_file(path)
        except OSError as error:
            raise FileFailure(os_error_reason(error), f"{type(error).__name__}: {error.strerror or error}") from None
        except ValueError as error:  # a NUL in a name from a hand-made list
            raise FileFailure("unreadable", str(error)) from None
        if not data:
            raise FileFailure("undecodable", "empty file")
        try:
            return self.transform(data)
        except BadImage as error:
            raise FileFailure("undecodable", str(error)) from None

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, int, list[BadFile]]:
        bad: list[BadFile] = []
        attempts = MAX_REPLACEMENTS if self.replace_bad else 1
        for attempt in range(attempts):
            current = (index + attempt) % len(self.paths)
            try:
                image = self.load(current)
                if not isinstance(image, torch.Tensor):  # planned for the device decoder: it names the file
                    image.name = f"{self.split_dir}/{self.paths[current]}"
                return image, int(self.labels[current]), bad
            except FileFailure as failure:
                bad.append(BadFile(f"{self.split_dir}/{self.paths[current]}", failure.reason, failure.detail,
                                   own=attempt == 0, row_end=self.replace_bad and attempt == attempts - 1))
        # Training: no readable file in MAX_REPLACEMENTS tries (a whole folder gone). The sample is
        # left out of its batch, and the trainer stops before training that batch (train/bad_data.py).
        return None, int(self.labels[index]), bad


def collate(batch: list[tuple[torch.Tensor | None, int, list[str]]]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Stack into one NHWC buffer (one contiguous copy per image) seen as a channels_last NCHW batch;
    samples planned for the device decoder (data/image/device_decode.py) stay encoded, in an EncodedBatch."""
    kept = [(image, label) for image, label, _ in batch if image is not None]
    bad = [entry for _, _, entries in batch for entry in entries]
    if kept and not isinstance(kept[0][0], torch.Tensor):
        from .device_decode import EncodedBatch

        samples = [image for image, _ in kept]
        return (EncodedBatch(samples, replace_bad=False, names=[getattr(s, "name", "") for s in samples]),
                torch.tensor([label for _, label in kept], dtype=torch.long), bad)
    if not kept:
        return torch.empty((0, 3, 1, 1), dtype=torch.uint8), torch.empty(0, dtype=torch.long), bad
    channels, height, width = kept[0][0].shape
    out = torch.empty((len(kept), height, width, channels), dtype=torch.uint8)
    for slot, (image, _) in zip(out, kept):
        slot.copy_(image.permute(1, 2, 0))
    labels = torch.tensor([label for _, label in kept], dtype=torch.long)
    return out.permute(0, 3, 1, 2), labels, bad


class CountingLoader:
    """Yields (images, labels) from a DataLoader of ``collate`` batches; notes bad files.

    ``tally`` holds this rank's failed files of the pass under way (bad_files.EpochTally);
    ``pop_epoch()`` hands it over and starts the next (the engine combines the ranks' tallies at
    the end of each epoch), ``pop_bad_files()`` its count of distinct files.
    """

    # The engine takes a step's batches one step ahead (engine.DeviceBatches), so that the files a
    # step would train on are counted before the ranks agree to take that step.
    counts_bad_files = True

    def __init__(self, loader: DataLoader, fail: bool, replace_bad: bool | None = None):
        self.loader = loader
        self.fail = fail
        self.tally = EpochTally()
        self.warned: set[str] = set()
        self.last_summary = None  # bad_files.Summary of the last pass, over every rank (engine.add_bad_files)
        # Whether a bad file's slot takes another image (training) or is dropped (validation), for
        # batches decoded later on the device; from the dataset (or a shard stream) by default.
        dataset = getattr(loader.dataset, "dataset", loader.dataset)
        self.replace_bad = bool(getattr(dataset, "replace_bad", getattr(dataset, "training", False))) \
            if replace_bad is None else replace_bad

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels, bad in self.loader:
            batch = self.accept(images, labels, bad)
            if batch is not None:
                yield batch

    def accept(self, images, labels: torch.Tensor, bad: list) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Count one collated batch (its samples and bad-file records); the (images, labels) to use,
        or None for a validation batch of bad files only (nothing to evaluate)."""
        dropped = 0 if self.replace_bad else sum(1 for entry in bad if getattr(entry, "own", True))
        self.note(bad, samples=len(labels) + dropped)
        if len(images) == 0:
            return None
        if not isinstance(images, torch.Tensor):  # an EncodedBatch: its bad files show on the device
            images.replace_bad, images.on_bad = self.replace_bad, self.note
        return images, labels

    def note(self, bad: list[str], samples: int = 0) -> None:
        """Count a batch of ``samples`` and its bad-file records (also the device decoder's, after
        the batch: ``samples`` 0); warn for the first few files; stop at once under ``fail``."""
        if bad and self.fail:
            raise BadFileError(f"{as_bad_file(bad[0]).reason} image file {bad[0]} (data.on_bad_file=fail; set "
                               f"data.on_bad_file=skip to skip such files)")
        for record in self.tally.note([as_bad_file(entry) for entry in bad], samples):
            if len(self.warned) < WARN_FILES:
                self.warned.add(record)
                print(f"hvdtrain: warning: skipping {record.reason} image file {record}", file=sys.stderr, flush=True)
                if len(self.warned) == WARN_FILES:
                    print("hvdtrain: warning: further bad files are counted in each epoch's line and listed in "
                          "bad_files.jsonl in output.dir, not named here", file=sys.stderr, flush=True)

    def pop_epoch(self) -> EpochTally:
        """This rank's tally of the pass just done; the next pass starts from zero."""
        tally, self.tally = self.tally, EpochTally()
        return tally

    def pop_bad_files(self) -> int:
        """Distinct files that failed in this rank's pass (and start the next from zero)."""
        return sum(self.pop_epoch().counts())

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset
