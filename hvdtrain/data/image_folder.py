"""An image-file dataset that survives the files real datasets contain, and its loader.

A file no decoder can read (truncated, empty, not an image) never stops training by default:

* training: the sample is replaced by the next decodable file in index order (deterministic), so
  every batch keeps its size and every rank runs exactly the same number of steps;
* validation: the sample is dropped from its batch (no image is counted twice; the exact metrics
  cover the decodable images).

Each bad file is named in a warning (once per process), counted per epoch, and the counts are
summed over ranks into the epoch metrics (``bad_files``). With ``data.on_bad_file=fail`` the first
bad file stops the run with one line naming it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .file_index import DataError
from .decode import BadImage, Transform, read_file

# A long run of undecodable files in index order means the data, not a few files, is broken.
MAX_REPLACEMENTS = 64


class BadFileError(DataError):
    """``data.on_bad_file=fail`` met an undecodable file."""


class ImageFiles(Dataset):
    """(uint8 CHW image or None, label, [bad file descriptions]) per index.

    ``paths`` and ``labels``: the file index's compact arrays (data/file_list.py), which a loader
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
            raise BadImage(f"{type(error).__name__}: {error.strerror or error}") from None
        except ValueError as error:  # a NUL in a name from a hand-made list
            raise BadImage(str(error)) from None
        if not data:
            raise BadImage("empty file")
        return self.transform(data)

    def __getitem__(self, index: int) -> tuple[torch.Tensor | None, int, list[str]]:
        bad: list[str] = []
        attempts = MAX_REPLACEMENTS if self.replace_bad else 1
        for attempt in range(attempts):
            current = (index + attempt) % len(self.paths)
            try:
                image = self.load(current)
                if not isinstance(image, torch.Tensor):  # planned for the device decoder: it names the file
                    image.name = f"{self.split_dir}/{self.paths[current]}"
                return image, int(self.labels[current]), bad
            except BadImage as error:
                bad.append(f"{self.split_dir}/{self.paths[current]} ({error})")
        if self.replace_bad:
            raise BadFileError(f"{MAX_REPLACEMENTS} undecodable files in a row from {self.split_dir}/"
                               f"{self.paths[index]} on: is the dataset intact?")
        return None, int(self.labels[index]), bad


def collate(batch: list[tuple[torch.Tensor | None, int, list[str]]]) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Stack into one NHWC buffer (one contiguous copy per image) seen as a channels_last NCHW batch;
    samples planned for the device decoder (data/device_decode.py) stay encoded, in an EncodedBatch."""
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

    ``pop_bad_files()`` returns the number met since the last call (the engine sums it over ranks
    at the end of each epoch).
    """

    def __init__(self, loader: DataLoader, fail: bool, replace_bad: bool | None = None):
        self.loader = loader
        self.fail = fail
        self.bad_files = 0
        self.warned: set[str] = set()
        # Whether a bad file's slot takes another image (training) or is dropped (validation), for
        # batches decoded later on the device; from the dataset (or a shard stream) by default.
        dataset = getattr(loader.dataset, "dataset", loader.dataset)
        self.replace_bad = bool(getattr(dataset, "replace_bad", getattr(dataset, "training", False))) \
            if replace_bad is None else replace_bad

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, labels, bad in self.loader:
            if bad:
                self.note(bad)
            if len(images) == 0:
                continue  # validation batch of bad files only: nothing to evaluate
            if not isinstance(images, torch.Tensor):  # an EncodedBatch: its bad files show on the device
                images.replace_bad, images.on_bad = self.replace_bad, self.note
            yield images, labels

    def note(self, bad: list[str]) -> None:
        if self.fail:
            raise BadFileError(f"undecodable image file {bad[0]} (data.on_bad_file=fail; set "
                               f"data.on_bad_file=skip to skip such files)")
        self.bad_files += len(bad)
        for entry in bad:
            if entry not in self.warned:
                self.warned.add(entry)
                print(f"hvdtrain: warning: skipping undecodable image file {entry}", file=sys.stderr, flush=True)

    def pop_bad_files(self) -> int:
        count, self.bad_files = self.bad_files, 0
        return count

    @property
    def dataset(self) -> Dataset:
        return self.loader.dataset
