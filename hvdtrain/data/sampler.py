"""The Horovod-aware sampler: one global order per epoch, split across ranks, resumable anywhere."""

from __future__ import annotations

import math
import random
from typing import Callable, Iterator

import torch
from torch.utils.data import Dataset, Sampler

from .decode import RESOLUTION

def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The random seed of one sample's augmentation in one epoch (a 63-bit mix of the three)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + index * 0x94D049BB133111EB) & (2**64 - 1)
    mixed ^= mixed >> 31
    return mixed & (2**63 - 1)


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

    def global_order(self) -> list[int]:
        """The epoch's permutation of all indices (the same for every number of ranks)."""
        if not self.shuffle:
            return list(range(self.num_samples_total))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.num_samples_total, generator=generator).tolist()

    def indices(self) -> list[int]:
        """This rank's dataset indices for the rest of the epoch, from global position ``start``."""
        order = self.global_order()
        rest = order[self.start:]
        if self.pad and order:
            short = -len(rest) % self.num_replicas
            rest = rest + (order * (short // len(order) + 1))[:short]
        return rest[self.rank::self.num_replicas]

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        if self.resolution is not None:
            size = self.resolution(self.epoch)
            return iter([(index, sample_seed(self.seed, self.epoch, index), size) for index in self.indices()])
        return iter([(index, sample_seed(self.seed, self.epoch, index)) for index in self.indices()])

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
