"""The order of a shard epoch: one global sequence of shards per epoch from the seed, split into
segments per rank and loader worker, each worker's seeded shuffle buffer, and what remains of an
epoch after a mid-epoch checkpoint (exact resume). Pure functions of numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..sampler import sample_seed
from .manifest import Split


def epoch_sequence(split: Split, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """Every record id of the split, shard by shard, the shards permuted by (seed, epoch)."""
    order = np.arange(len(split.names))
    if shuffle:
        generator = torch.Generator().manual_seed(seed * 1000003 + epoch)
        order = torch.randperm(len(split.names), generator=generator).numpy()
    if not len(order):
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(split.offsets[s], split.offsets[s + 1]) for s in order])


def buffer_order(ids: np.ndarray, size: int, seed: int) -> np.ndarray:
    """The order a shuffle buffer of ``size`` records emits ``ids`` in (webdataset's algorithm:
    fill the buffer, then emit a random slot and put the next record there; drain it shuffled)."""
    if size <= 1 or len(ids) <= 1:
        return ids.copy()
    rng = np.random.Generator(np.random.PCG64(seed))
    buffer = ids[:size].tolist()
    incoming = ids[size:].tolist()
    slots = rng.integers(0, len(buffer), len(incoming)).tolist()
    out = [0] * len(incoming)
    for at, (slot, value) in enumerate(zip(slots, incoming)):
        out[at] = buffer[slot]
        buffer[slot] = value
    return np.concatenate([np.array(out, dtype=np.int64), rng.permutation(np.array(buffer, dtype=np.int64))])


def fit(chunk: np.ndarray, length: int, fallback: np.ndarray) -> np.ndarray:
    """``chunk`` cut to ``length`` records, or extended by repeating its own first records."""
    if len(chunk) >= length:
        return chunk[:length]
    source = chunk if len(chunk) else fallback
    return np.concatenate([chunk, np.resize(source, length - len(chunk))])


@dataclass(frozen=True)
class Segment:
    """A stretch of an epoch read by one set of ranks: from ``start`` samples consumed (all ranks
    together) on, ``world`` ranks of ``workers`` loader workers and ``batch`` images per batch
    each run ``quota`` batches (at most)."""

    world: int
    workers: int
    batch: int
    start: int
    quota: int

    def as_list(self) -> list[int]:
        return [self.world, self.workers, self.batch, self.start, self.quota]


def worker_parts(sequence: np.ndarray, segment: Segment, rank: int) -> list[np.ndarray]:
    """Rank ``rank``'s chunk of ``sequence``, fitted to its quota and cut into its workers' parts."""
    chunk = np.array_split(sequence, segment.world)[rank]
    chunk = fit(chunk, segment.quota * segment.batch, sequence)
    parts, at = [], 0
    for worker in range(segment.workers):
        length = len(range(worker, segment.quota, segment.workers)) * segment.batch
        parts.append(chunk[at:at + length])
        at += length
    return parts


def part_seed(seed: int, epoch: int, index: int, rank: int, worker: int) -> int:
    return sample_seed(seed, epoch * 4099 + index, rank * 65537 + worker + 1)


def rank_stream(sequence: np.ndarray, segment: Segment, rank: int, shuffle_buffer: int, seed: int,
                epoch: int, index: int) -> list[np.ndarray]:
    """Each worker's record ids of rank ``rank`` in emission order (worker w: batches w, w+K, ...)."""
    return [buffer_order(part, shuffle_buffer, part_seed(seed, epoch, index, rank, worker))
            for worker, part in enumerate(worker_parts(sequence, segment, rank))]


def batches_of(orders: list[np.ndarray], workers: int, batch: int, count: int) -> np.ndarray:
    """The first ``count`` batches of a rank's stream, concatenated."""
    rows = [orders[j % workers][(j // workers) * batch:(j // workers + 1) * batch] for j in range(count)]
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


def remaining_sequence(split: Split, segments: list[Segment], consumed: list[int], shuffle_buffer: int,
                       seed: int, epoch: int) -> np.ndarray:
    """The epoch's records not yet consumed after the closed ``segments`` (``consumed[k]``: samples
    all ranks consumed in segment k), in the epoch's shard order."""
    sequence = epoch_sequence(split, seed, epoch)
    for index, (segment, used) in enumerate(zip(segments, consumed)):
        per_rank = used // segment.world // segment.batch
        seen = [batches_of(rank_stream(sequence, segment, rank, shuffle_buffer, seed, epoch, index),
                           segment.workers, segment.batch, per_rank) for rank in range(segment.world)]
        sequence = sequence[~np.isin(sequence, np.concatenate(seen))]
    return sequence
