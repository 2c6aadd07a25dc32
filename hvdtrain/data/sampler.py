"""The Horovod-aware sampler: one global order per epoch, split across ranks, resumable anywhere."""

from __future__ import annotations

import math
import random
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from .decode import RESOLUTION

SEED_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
CHUNK = 4096  # samples turned into Python tuples at a time by the iterator


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The random seed of one sample's augmentation in one epoch (a 63-bit mix of the three)."""
    mixed = (seed * SEED_MIX[0] + epoch * SEED_MIX[1] + index * SEED_MIX[2]) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


def sample_seeds(seed: int, epoch: int, indices: np.ndarray) -> np.ndarray:
    """``sample_seed`` of every index at once (int64): numpy's uint64 arithmetic wraps modulo 2**64,
    as the scalar version's ``& (2**64 - 1)`` does."""
    base = np.uint64((seed * SEED_MIX[0] + epoch * SEED_MIX[1]) & (2**64 - 1))
    mixed = np.asarray(indices).astype(np.uint64) * np.uint64(SEED_MIX[2]) + base
    mixed ^= mixed >> np.uint64(31)
    return (mixed & np.uint64(2**63 - 1)).astype(np.int64)


class ShardedSampler(Sampler[tuple[int, int]]):
    """The global order of an epoch, split across ranks, resumable at any position.

    Every epoch draws one permutation of the whole dataset from ``seed + epoch`` (independent of
    the number of ranks). Rank ``r`` of ``n`` takes positions ``r, r + n, r + 2n, ...``, so that the
    k-th batches of all ranks together are exactly the k-th global batch of ``n x batch`` images a
    single process would draw. With ``pad`` the order is extended by wrapping around so that every
    rank gets the same number of samples (training); without it no index is repeated and every
    index belongs to exactly one rank (validation).

    It yields ``(index, augmentation seed)`` pairs (see ``SeededSamples``): each sample's random
    augmentation depends only on (seed, epoch, index), not on which rank or loader worker draws
    it, nor on where a run was resumed. ``set_epoch(epoch, start)`` starts at global position
    ``start`` of the epoch's order (the samples all ranks have consumed so far), so a run resumed
    mid-epoch, with the same or another number of ranks, neither skips nor repeats a sample.
    """

    def __init__(self, num_samples: int, num_replicas: int, rank: int, seed: int = 0,
                 shuffle: bool = True, pad: bool = True, resolution: Callable[[int], int] | None = None):
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} out of range for {num_replicas} replicas")
        self.num_samples_total = num_samples
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.pad = pad
        self.epoch = 0
        self.start = 0
        # Progressive resizing: epoch -> training resolution, sent with every sample (a pure
        # function of the epoch, so a resumed run loads at the same size).
        self.resolution = resolution

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start

    def global_order(self) -> np.ndarray:
        """The epoch's permutation of all indices (the same for every number of ranks)."""
        if not self.shuffle:
            return np.arange(self.num_samples_total, dtype=np.int64)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        # int32 where it fits: half the memory, and the same permutation (randperm draws the same
        # random numbers whatever the dtype; tests/unit/test_sampler_scale.py checks it).
        dtype = torch.int32 if self.num_samples_total < 2**31 else torch.int64
        return torch.randperm(self.num_samples_total, generator=generator, dtype=dtype).numpy()

    def index_array(self) -> np.ndarray:
        """This rank's dataset indices for the rest of the epoch, from global position ``start``:
        positions ``start + rank``, ``start + rank + n``, ... of the epoch's order, then (with
        ``pad``) the order again from its beginning until every rank has as many (int64)."""
        order = self.global_order()
        total, replicas = len(order), self.num_replicas
        rest = max(0, total - self.start)
        taken = order[self.start + self.rank::replicas] if rest else order[:0]
        if not (self.pad and total):
            return taken.astype(np.int64)
        padded = np.arange(self.rank + len(taken) * replicas, rest + (-rest % replicas), replicas)
        return np.concatenate([taken, order[(padded - rest) % total]]).astype(np.int64)

    def indices(self) -> list[int]:
        """``index_array()`` as a list (e.g. for JSON); the sampler itself never builds one."""
        return self.index_array().tolist()

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        # The epoch's order is drawn now (as set_epoch left it); the tuples are made a chunk at a time.
        indices = self.index_array()
        seeds = sample_seeds(self.seed, self.epoch, indices)
        size = self.resolution(self.epoch) if self.resolution is not None else None
        return self.pairs(indices, seeds, size)

    @staticmethod
    def pairs(indices: np.ndarray, seeds: np.ndarray, size: int | None) -> Iterator[tuple[int, ...]]:
        for first in range(0, len(indices), CHUNK):
            chunk = zip(indices[first:first + CHUNK].tolist(), seeds[first:first + CHUNK].tolist())
            if size is None:
                yield from chunk
            else:  # a third element: the epoch's training resolution (progressive resizing)
                yield from ((index, seed, size) for (index, seed) in chunk)

    def __len__(self) -> int:
        remaining = max(0, self.num_samples_total - self.start)
        if self.pad:
            return math.ceil(remaining / self.num_replicas)
        return len(range(self.rank, remaining, self.num_replicas))


class SeededSamples(Dataset):
    """Wraps a dataset so that ``dataset[(index, seed)]`` runs its transform under ``seed``.

    torchvision's random transforms draw from the global torch (and Python) generators; they are
    seeded per sample and restored afterwards, so the caller's random streams (dropout, say) are
    untouched when loading happens in the training process.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]):
        index, seed = key[0], key[1]
        python_state = random.getstate()
        # A third element is the epoch's training resolution (progressive resizing).
        token = RESOLUTION.set(key[2]) if len(key) > 2 else None
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                return self.dataset[index]
            finally:
                random.setstate(python_state)
                if token is not None:
                    RESOLUTION.reset(token)
