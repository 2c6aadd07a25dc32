"""Training and validation from WebDataset tar shards (``hvdtrain prepare``'s output), local or remote.

Sequential reads of a few hundred large files instead of random reads of a million small ones:
a rank opens one file per shard it reads, and a URL (``s3://bucket/prefix``, any fsspec URL)
works like a folder. The manifest's image counts make the whole epoch's sample order a pure
function of (seed, epoch, ranks, loader workers, batch size), computed from counts alone before
a byte is read; readers then stream their shards and emit records in that order.

Training, one epoch (a *segment*; see resume below):

1. the shards are permuted by (seed, epoch); their records, concatenated in that order, are cut
   into one contiguous chunk per rank (sizes differ by at most one record);
2. every rank runs the same number of batches, ``ceil(N / ranks) // batch`` (what the folder
   loader's padded sampler gives). A rank whose chunk is short makes up the shortfall by repeating
   the first records of its own chunk; records beyond that count (fewer than one batch per rank)
   are left out of this epoch, as ``drop_last`` leaves out the folder loader's last partial batch;
3. a rank's chunk is cut into one contiguous part per loader worker, worker ``w`` producing the
   rank's batches ``w, w + K, w + 2K, ...`` (the DataLoader takes batches from its workers in turn,
   so the rank's batch order does not depend on timing);
4. each worker shuffles its part through a buffer of ``data.shuffle_buffer`` records (the
   webdataset algorithm: fill the buffer, then emit a random slot and refill it), seeded by (seed,
   epoch, segment, rank, worker). Each record's augmentation is seeded by (seed, epoch, record).

Resume: the position is the epoch and the samples consumed (``RunState``'s position; this
loader's component in the state, ``shard_loader``, adds the layout each part of the epoch was
read with). With the same number of ranks a resumed rank computes its stream again and skips the
batches already consumed, without decoding them and without opening shards that hold none of the
rest, so parameters continue bitwise. With another number of ranks, the records the old ranks
consumed are computed from counts, removed, and the rest of the epoch (in the epoch's shard order)
is laid out again over the new ranks as a new segment: no image is seen twice, and fewer than one
global batch is left out (the steps already counted for the rounded-down step); the run says so.

Validation: rank ``r`` of ``n`` reads records ``[r N / n, (r + 1) N / n)`` of the manifest order,
split contiguously over its workers: every image exactly once for any number of ranks.

Undecodable records: in training, replaced by the first decodable record of the same batch (with
that record's label and the bad record's augmentation seed), so batches keep their size; in
validation, dropped. Either way named, counted (``bad_files``), or fatal with
``data.on_bad_file=fail`` (image_folder.CountingLoader).

Shards that vanish mid-run: read.py (what a worker sends for them) and taking.py (how the ranks
stop before the step that needs one).
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..files.bad_files import BadFile, BadFileError
from ..files.index import DataError
from ..image.decode import BadImage, Transform
from ..image.folder import collate
from ..image.resolution import RESOLUTION
from ..sampler import sample_seed
from .manifest import Manifest, Split
from .order import Segment, buffer_order, part_seed, remaining_sequence, worker_parts
from .read import BAD_LABEL, ShardFailure, hole, read_records
from .taking import ShardLoader


class ShardStream(IterableDataset):
    """One rank's batches of a split, as collated (uint8 images, labels, bad records) tuples.

    ``set_epoch(epoch, start)`` chooses the epoch and the samples all ranks consumed so far; the
    DataLoader (batch_size=None) runs one copy per worker, which reads that position from shared
    memory when its epoch begins. Also the state component ``shard_loader``.
    """

    def __init__(self, manifest: Manifest, split: str, rank: int, world: int, workers: int, batch: int,
                 transform: Transform, seed: int, shuffle_buffer: int, training: bool,
                 resolution: Callable[[int], int] | None = None):
        self.manifest, self.split_name = manifest, split
        # Progressive resizing: epoch -> training resolution (a picklable pure function of the epoch).
        self.resolution = resolution
        self.split: Split = getattr(manifest, split)
        self.rank, self.world, self.workers, self.batch = rank, world, max(1, workers), batch
        self.transform, self.seed, self.shuffle_buffer, self.training = transform, seed, shuffle_buffer, training
        self.epoch = 0
        self.full_quota = math.ceil(self.split.size / world) // batch if training else 0
        self.segments: list[Segment] = [Segment(world, self.workers, batch, 0, self.full_quota)]
        self.consumed: list[int] = []   # samples consumed in each closed segment
        self.skip = 0                   # batches of the current segment already consumed (resume)
        self.batches_taken = 0          # batches the trainer took since set_epoch (main process)
        self.pending: dict[str, Any] | None = None
        self.notes: list[str] = []
        # Persistent loader workers hold their own copy of this object; the position of each epoch
        # reaches them through this shared-memory buffer (JSON), written by set_epoch.
        self.shared = torch.zeros(1 << 16, dtype=torch.uint8).share_memory_()
        self.publish()

    def publish(self) -> None:
        text = json.dumps({"epoch": self.epoch, "segments": [s.as_list() for s in self.segments],
                           "consumed": self.consumed, "skip": self.skip}).encode()
        if len(text) + 4 > len(self.shared):
            raise DataError("shard loader position too long (more than a few hundred resumes in one epoch)")
        self.shared[:4] = torch.tensor(list(len(text).to_bytes(4, "little")), dtype=torch.uint8)
        self.shared[4:4 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)

    def receive(self) -> None:
        """In a loader worker: the position the training process published last."""
        length = int.from_bytes(bytes(self.shared[:4].tolist()), "little")
        state = json.loads(bytes(self.shared[4:4 + length].numpy()).decode())
        self.epoch, self.consumed, self.skip = state["epoch"], state["consumed"], state["skip"]
        self.segments = [Segment(*entry) for entry in state["segments"]]

    # -- position -------------------------------------------------------------------------------
    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Start ``epoch`` after ``start`` samples consumed by all ranks (a multiple of a global batch)."""
        try:
            self.place(epoch, start)
        finally:
            self.publish()

    def place(self, epoch: int, start: int) -> None:
        pending, self.pending = self.pending, None
        self.epoch, self.batches_taken = epoch, 0
        fresh = Segment(self.world, self.workers, self.batch, 0, self.full_quota)
        self.segments, self.consumed, self.skip = [fresh], [], start // (self.world * self.batch)
        if not (pending and pending["epoch"] == epoch and start and pending["segments"]):
            return
        segments = [Segment(*entry) for entry in pending["segments"]]
        last = segments[-1]
        if (last.world, last.workers, last.batch) == (self.world, self.workers, self.batch):
            self.segments, self.consumed = segments, list(pending["consumed"])
            self.skip = (start - last.start) // (self.world * self.batch)
            return
        # Another layout: the consumed records are taken out and the rest laid out again.
        consumed = list(pending["consumed"]) + [pending["total"] - last.start]
        quota = self.full_quota - start // (self.world * self.batch)
        self.segments = segments + [Segment(self.world, self.workers, self.batch, pending["total"], quota)]
        self.consumed, self.skip = consumed, 0
        left = self.split.size - pending["total"]
        self.notes.append(f"shards: the checkpoint's epoch was read by {last.world} ranks x {last.workers} workers "
                          f"x {last.batch}, this job has {self.world} x {self.workers} x {self.batch}: the "
                          f"{left} images not yet seen in epoch {epoch + 1} are dealt again ({quota} steps; "
                          f"none seen twice, {max(0, left - quota * self.batch * self.world)} left out)")

    def state_dict(self) -> dict[str, Any]:
        if self.pending is not None:  # loaded, not yet applied by set_epoch (the resume broadcast)
            return dict(self.pending)
        last = self.segments[-1]
        total = last.start + (self.skip + self.batches_taken) * last.world * last.batch
        return {"epoch": self.epoch, "segments": [s.as_list() for s in self.segments],
                "consumed": list(self.consumed), "total": total}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = dict(state) if state.get("segments") else None

    def __len__(self) -> int:
        if self.training:
            return max(0, self.segments[-1].quota - self.skip)
        start, end = self.val_range()
        return math.ceil((end - start) / self.batch)

    # -- the records of this worker --------------------------------------------------------------
    def val_range(self) -> tuple[int, int]:
        size = self.split.size
        return self.rank * size // self.world, (self.rank + 1) * size // self.world

    def worker(self) -> tuple[int, int]:
        info = get_worker_info()
        if info is None:
            return 0, 1
        if info.num_workers != self.workers:
            raise DataError(f"shard loader built for {self.workers} workers runs with {info.num_workers}")
        return info.id, info.num_workers

    def plan(self) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(ids to read in order, ids to emit in order, per-batch sizes) for this worker."""
        worker, workers = self.worker()
        if not self.training:
            start, end = self.val_range()
            batches = np.array_split(np.arange(math.ceil((end - start) / self.batch)), workers)[worker]
            if not len(batches):
                return np.zeros(0, np.int64), np.zeros(0, np.int64), []
            first, last = start + batches[0] * self.batch, min(end, start + (batches[-1] + 1) * self.batch)
            ids = np.arange(first, last, dtype=np.int64)
            return ids, ids, [min(self.batch, last - first - i * self.batch) for i in range(len(batches))]
        segment, index = self.segments[-1], len(self.segments) - 1
        sequence = remaining_sequence(self.split, self.segments[:-1], self.consumed, self.shuffle_buffer,
                                      self.seed, self.epoch)
        # After a skip of S batches the DataLoader still asks worker 0 first: physical worker p
        # produces logical worker (S + p) % K's batches, from batch S on.
        logical = (self.skip + worker) % workers
        part = worker_parts(sequence, segment, self.rank)[logical]
        order = buffer_order(part, self.shuffle_buffer, part_seed(self.seed, self.epoch, index, self.rank, logical))
        first = max(0, -(-(self.skip - logical) // workers))
        emit = order[first * self.batch:]
        return part, emit, [self.batch] * (len(emit) // self.batch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        if get_worker_info() is not None:
            self.receive()
        read, emit, sizes = self.plan()
        records = read_records(self.manifest.root, self.split, read, set(emit.tolist()))
        held: dict[int, tuple[str, bytes, int]] = {}
        at = 0
        for size in sizes:
            items = []
            for record in emit[at:at + size].tolist():
                while record not in held:
                    try:
                        got, name, data, label = next(records)
                    except StopIteration:
                        raise DataError(f"shard data ended before record {record} of {self.split_name}: "
                                        f"shards changed since manifest.json was written?") from None
                    held[got] = (name, data, label)
                items.append((record, *held.pop(record)))
            at += size
            failure = next((data for _, _, data, _ in items if isinstance(data, ShardFailure)), None)
            if failure is not None and self.training:
                yield hole(failure)  # nothing after it: the ranks stop before the step that would take it
                return
            yield collate(self.decode_batch(items))

    def decode_batch(self, items: list[tuple[int, str, bytes | ShardFailure, int]]
                     ) -> list[tuple[torch.Tensor | None, int, list[str]]]:
        out: list[tuple[torch.Tensor | None, int, list[str]]] = []
        bad: list[tuple[int, str]] = []
        for slot, (record, name, data, label) in enumerate(items):
            if isinstance(data, ShardFailure):  # validation: dropped, counted per record
                bad.append((slot, BadFile(name, data.reason, data.detail)))
                out.append((None, label, []))
                continue
            image, error = self.decode(record, data, label)
            if image is None:
                bad.append((slot, f"{name} ({error})"))
            out.append((image, label, []))
        if not bad:
            return out
        if not self.training:
            for slot, text in bad:
                out[slot] = (None, out[slot][1], [text])
            return out
        good = [slot for slot, (image, _, _) in enumerate(out) if image is not None]
        if not good:
            raise BadFileError(f"a whole batch of undecodable records, from {bad[0][1]} on: are the shards intact?")
        donor = good[0]
        for slot, text in bad:
            record = items[slot][0]
            image, _ = self.decode(record, items[donor][2], items[donor][3])
            out[slot] = (image, items[donor][3], [text])
        return out

    def decode(self, record: int, data: bytes, label: int) -> tuple[torch.Tensor | None, str]:
        if label == BAD_LABEL:
            return None, "a .cls label that is not a number"
        if label < 0:
            return None, "no .cls label"
        if label >= len(self.manifest.classes):  # a label the model's head has no output for
            return None, f"label {label} outside the {len(self.manifest.classes)} classes of manifest.json"
        if not data:
            return None, "no image member"
        token = RESOLUTION.set(self.resolution(self.epoch)) if self.resolution is not None else None
        with torch.random.fork_rng(devices=[]):
            # The CPU generator alone: torch.manual_seed also queues seeds for CUDA, MTIA and XPU,
            # formatting a stack trace for each, which costs more than decoding a small image.
            torch.default_generator.manual_seed(sample_seed(self.seed, self.epoch, record))
            try:
                return self.transform(data), ""
            except BadImage as error:
                return None, str(error)
            finally:
                if token is not None:
                    RESOLUTION.reset(token)


def shard_loaders(manifest: Manifest, rank: int, world: int, batch: int, train_transform: Transform,
                  val_transform: Transform, seed: int, shuffle_buffer: int, fail: bool,
                  kwargs: dict, make_loader: Callable, resolution: Callable[[int], int] | None = None
                  ) -> tuple[ShardLoader, ShardLoader, ShardStream]:
    """The training and validation loaders of one rank, and the training stream (its position);
    ``resolution`` is progressive resizing's epoch -> training size."""
    workers = kwargs.get("num_workers", 0)
    train = ShardStream(manifest, "train", rank, world, workers, batch, train_transform, seed, shuffle_buffer, True,
                        resolution)
    val = ShardStream(manifest, "val", rank, world, workers, batch, val_transform, seed, 0, False)
    return (ShardLoader(make_loader(train, batch_size=None, **kwargs), train, fail),
            ShardLoader(make_loader(val, batch_size=None, **kwargs), val, fail), train)


def describe(manifest: Manifest) -> str:
    return (f"shards of {manifest.root}: {len(manifest.train.names)} train / {len(manifest.val.names)} val "
            f"shards, one file opened per shard")


__all__ = ["Manifest", "ShardStream", "ShardLoader", "shard_loaders", "buffer_order", "remaining_sequence", "Segment"]
