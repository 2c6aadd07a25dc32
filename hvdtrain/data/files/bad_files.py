"""Files that fail while a split is read: what failed and why, counted as distinct files.

A file that fails is *missing* (gone: ENOENT, ENOTDIR, as when a volume is unmounted or a folder
deleted), *unreadable* (there but not readable: permissions, EIO, a stale NFS handle) or
*undecodable* (read, but no decoder makes an image of it). A training sample whose file fails is
replaced by the next file in index order (image_folder.ImageFiles), so one vanished folder is met
many times per epoch as replacement candidates; only the sample's *own* file is counted
(``BadFile.own``). Every index of an epoch is drawn by exactly one rank (sampler.ShardedSampler),
so the per-rank counts of own files add up over ranks to the epoch's distinct failed files, and
the records gathered from every rank give their exact union (``summarize``).

Records travel with the batches from the loader workers (the third element of a collated batch),
so nothing is lost between processes and nothing is counted before the trainer takes the batch.
Nothing here runs anything named by a file: paths are data, written as JSON strings.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

import torch

from .index import DataError

REASONS = ("missing", "unreadable", "undecodable")
MISSING_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR})
# Per-file warnings each rank prints before it leaves the rest to the epoch's summary line.
WARN_FILES = 3


class BadFileError(DataError):
    """``data.on_bad_file=fail`` met an undecodable file (or a whole batch decoded nothing)."""


class BadFile(str):
    """One failed read of one file. Its text is ``path (error)``, as warnings and the older string
    records (shards, the device decoder) name it; picklable: it comes back from a loader worker with
    its batch."""

    path: str
    reason: str           # one of REASONS
    detail: str           # the error, e.g. "FileNotFoundError: No such file or directory"
    own: bool             # the sample's own file; False: met as a replacement candidate (not counted)
    row_end: bool         # the last of MAX_REPLACEMENTS failures in a row: the sample has no image
    shard: bool           # a training tar shard that could not be read: its batches have no images (a hole)

    def __new__(cls, path: str, reason: str, detail: str, own: bool = True, row_end: bool = False,
                shard: bool = False) -> "BadFile":
        record = super().__new__(cls, f"{path} ({detail})")
        record.path, record.reason, record.detail, record.own, record.row_end = path, reason, detail, own, row_end
        record.shard = shard
        return record

    def __reduce__(self):
        return BadFile, fields(self)


def os_error_reason(error: OSError) -> str:
    """missing for a file or folder that is gone, unreadable for any other OSError."""
    return "missing" if error.errno in MISSING_ERRNOS or isinstance(error, FileNotFoundError) else "unreadable"


def as_bad_file(entry: BadFile | str) -> BadFile:
    """A record, from the structured form or from the ``"path (error)"`` text that the shard loader
    and the device decoder give (an undecodable record or image, always the sample's own)."""
    if isinstance(entry, BadFile):
        return entry
    path, _, detail = str(entry).partition(" (")
    return BadFile(path, "undecodable", detail.removesuffix(")") or "undecodable")


@dataclass
class EpochTally:
    """One rank's failed files of one pass over a split (the trainer's process): own files once
    each, the samples read, and whether a sample ran out of replacements."""

    files_read: int = 0
    own: dict[str, BadFile] = field(default_factory=dict)   # path -> first record, in the order met
    row_end: BadFile | None = None

    def note(self, records: Iterable[BadFile], samples: int) -> list[BadFile]:
        """Count one batch; returns the records of files this rank had not counted yet this epoch."""
        self.files_read += samples
        new = []
        for record in records:
            if record.row_end and self.row_end is None:
                self.row_end = record
            if record.own and record.path not in self.own:
                self.own[record.path] = record
                new.append(record)
        return new

    def counts(self) -> list[int]:
        """[missing, unreadable, undecodable] of this rank's own files."""
        found = Counter(record.reason for record in self.own.values())
        return [found[reason] for reason in REASONS]

    def vector(self) -> torch.Tensor:
        """What the ranks sum at a step boundary: [missing, unreadable, undecodable, samples out of
        replacements, files read] (float64: exact for any realistic count)."""
        return torch.tensor(self.counts() + [1.0 if self.row_end is not None else 0.0, float(self.files_read)],
                            dtype=torch.float64)


@dataclass
class Summary:
    """The failed files of one split in one epoch, over every rank (the same on every rank)."""

    files_read: int = 0
    by_reason: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    records: list[BadFile] = field(default_factory=list)   # distinct own files, rank 0's first
    row_end: BadFile | None = None

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def folder_most_affected(self) -> tuple[str, int]:
        folders = Counter(os.path.dirname(record.path) for record in self.records)
        return folders.most_common(1)[0] if folders else ("", 0)

    def first(self, reason: str | None = None) -> BadFile | None:
        return next((r for r in self.records if reason is None or r.reason == reason), None)

    def metrics(self) -> dict[str, int]:
        """The epoch record's keys: the distinct count, and one per reason where there are any."""
        found = {"bad_files": self.total}
        if self.total:
            found.update({f"bad_files_{reason}": count for reason, count in self.by_reason.items()})
        return found

    def reasons(self) -> str:
        return ", ".join(f"{count} {reason}" for reason, count in self.by_reason.items() if count)


def summarize(gathered: Sequence[tuple[int, list[BadFile], BadFile | None]]) -> Summary:
    """One Summary from every rank's (files read, own records, row end), in rank order: the union
    of the records (a file counted by two ranks, which the padding of an epoch's last batch can
    make, counts once)."""
    summary = Summary(files_read=sum(files for files, _, _ in gathered))
    seen: set[str] = set()
    for _, records, row_end in gathered:
        summary.row_end = summary.row_end or row_end
        for record in records:
            if record.path not in seen:
                seen.add(record.path)
                summary.records.append(record)
                summary.by_reason[record.reason] += 1
    return summary


def combine(tally: EpochTally, allreduce_sum: Callable[[torch.Tensor], torch.Tensor],
            allgather: Callable[[object], list]) -> Summary:
    """Every rank's tally of a split's epoch as one Summary (collectives: every rank calls it). The
    records are gathered only when some rank has any (the sum says so on every rank alike)."""
    totals = allreduce_sum(tally.vector())
    if float(totals[:4].sum()) == 0:
        return Summary(files_read=int(totals[4]))
    gathered = allgather((tally.files_read, [fields(record) for record in tally.own.values()],
                          None if tally.row_end is None else fields(tally.row_end)))
    return summarize([(files, [BadFile(*record) for record in records], None if end is None else BadFile(*end))
                      for files, records, end in gathered])


def fields(record: BadFile) -> tuple:
    """A record as plain values, the form it travels in between ranks (comm/wire.py)."""
    return (record.path, record.reason, record.detail, record.own, record.row_end, record.shard)


def allowed_failures(max_fraction: float, epoch_files: int) -> int:
    """How many distinct files of an epoch may fail before the run stops (``data.max_bad_fraction``
    of the epoch's samples, rounded down: 1% of 192 files allows 1)."""
    return int(max_fraction * epoch_files + 1e-9)


def over_limit(totals: Sequence[float], max_fraction: float, epoch_files: int) -> bool:
    """Whether the summed step-boundary vector (``EpochTally.vector``) says stop: more failed files
    than allowed, or a sample that found no readable file in MAX_REPLACEMENTS tries."""
    return sum(totals[:3]) > allowed_failures(max_fraction, epoch_files) or totals[3] > 0


def validation_over_limit(summary: Summary | None, max_fraction: float, split_size: int) -> bool:
    """Whether one validation pass lost more of the split's samples (``split_size``, all ranks; the
    samples read when 0) than ``data.max_bad_fraction`` allows: its metrics would leave them out."""
    if summary is None or not summary.total:
        return False
    return summary.total > allowed_failures(max_fraction, split_size or summary.files_read)


def vanished_classes(saved: dict, now: dict, source: str, split_dir: str) -> str | None:
    """The line that refuses to resume where the class folders differ from the checkpoint's
    (``checkpoint_metadata()["classes"]``): a folder gone would shift every label after it, and
    with ``model.num_classes`` set the model would still fit; None where they agree or either
    side records none."""
    before, after = saved.get("classes"), now.get("classes")
    if not isinstance(before, list) or not after or before == after:
        return None
    gone = [name for name in before if name not in set(after)]
    if gone:
        return (f"class folder(s) {', '.join(map(str, gone[:3]))}{' ...' if len(gone) > 3 else ''} of checkpoint "
                f"{source} are missing from {split_dir} ({len(gone)} of its {len(before)} classes: deleted, or a "
                f"volume not mounted?); the labels after them would shift. Restore them, or start a new run in "
                f"another output.dir")
    new = [name for name in after if name not in set(before)]
    return (f"{split_dir} has class folder(s) {', '.join(map(str, new[:3]))}{' ...' if len(new) > 3 else ''} that "
            f"checkpoint {source} was not trained with; the labels would shift. Remove them, or start a new run "
            f"in another output.dir")
