"""Batches of ratings for the recommendation task: explicit ratings, implicit feedback with sampled
negatives, and ranked validation candidates, all built vectorized from a ``ShardedSampler``.

Randomness never comes from a generator's running state: every negative item is a hash of
(seed, epoch, sample index, attempt), so a batch depends only on which samples it holds, whatever
the number of ranks and wherever a run was resumed.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import numpy as np
import torch

from ..sampler import ShardedSampler

# The "epoch" of validation candidates: fixed, so every epoch ranks the same candidates.
VALIDATION_EPOCH = 1_000_003
MAX_ATTEMPTS = 64
_M1, _M2, _M3 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, element-wise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def hashed_items(seed: int, epoch: int, keys: np.ndarray, attempt: int, num_items: int) -> np.ndarray:
    """A uniform item per key, a pure function of (seed, epoch, key, attempt)."""
    with np.errstate(over="ignore"):
        base = np.uint64((seed * 0x9E3779B1 + epoch * 0x85EBCA77 + attempt * 0xC2B2AE3D) % 2**64)
        x = mix64(keys.astype(np.uint64) * _M3 + base)
    return (x % np.uint64(num_items)).astype(np.int64)


class PairSet:
    """Membership of (user, item) pairs, vectorized: sorted keys user * num_items + item."""

    def __init__(self, users: np.ndarray, items: np.ndarray, num_items: int):
        self.num_items = num_items
        self.keys = np.unique(users.astype(np.int64) * num_items + items)

    def contains(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        keys = users * self.num_items + items
        where = np.searchsorted(self.keys, keys)
        where = np.minimum(where, len(self.keys) - 1)
        return self.keys[where] == keys


def sample_negatives(users: np.ndarray, keys: np.ndarray, seed: int, epoch: int, positives: PairSet) -> np.ndarray:
    """For each user, an item it has no positive for (drawn again while it has; after MAX_ATTEMPTS
    the last draw stays, which only a user who rated nearly every item can reach)."""
    items = hashed_items(seed, epoch, keys, 0, positives.num_items)
    redo = np.flatnonzero(positives.contains(users, items))
    attempt = 1
    while len(redo) and attempt < MAX_ATTEMPTS:
        items[redo] = hashed_items(seed, epoch, keys[redo], attempt, positives.num_items)
        redo = redo[positives.contains(users[redo], items[redo])]
        attempt += 1
    return items


class SampledBatches:
    """A loader over a ``ShardedSampler``: each batch is ``make_batch(indices, epoch)``.

    ``len`` is this rank's number of batches in a whole epoch (as a DataLoader's with the same
    sampler); iteration starts where ``sampler.set_epoch(epoch, start)`` says.
    """

    def __init__(self, sampler: ShardedSampler, batch_size: int, drop_last: bool,
                 make_batch: Callable[[np.ndarray, int], tuple]):
        self.sampler, self.batch_size, self.drop_last, self.make_batch = sampler, batch_size, drop_last, make_batch

    def __len__(self) -> int:
        count = len(self.sampler)
        return count // self.batch_size if self.drop_last else math.ceil(count / self.batch_size)

    def __iter__(self) -> Iterator[tuple]:
        indices = self.sampler.index_array()
        end = len(indices) - len(indices) % self.batch_size if self.drop_last else len(indices)
        for start in range(0, end, self.batch_size):
            yield self.make_batch(indices[start:start + self.batch_size], self.sampler.epoch)


class ExplicitRatings:
    """Samples are ratings: ``(users, items), ratings``."""

    def __init__(self, users: np.ndarray, items: np.ndarray, ratings: np.ndarray):
        self.users, self.items, self.ratings = torch.from_numpy(users), torch.from_numpy(items), \
            torch.from_numpy(ratings)

    def __len__(self) -> int:
        return len(self.users)

    def batch(self, indices: np.ndarray, epoch: int) -> tuple:
        index = torch.from_numpy(indices)
        return (self.users[index], self.items[index]), self.ratings[index]


class ImplicitPairs:
    """Each positive followed by ``negatives`` sampled negatives: sample ``j`` is positive ``j // (1 + k)``
    when ``j % (1 + k) == 0``, else a negative for that positive's user drawn from (seed, epoch, j)."""

    def __init__(self, users: np.ndarray, items: np.ndarray, negatives: int, positives: PairSet, seed: int):
        self.users, self.items, self.negatives, self.positives, self.seed = users, items, negatives, positives, seed

    def __len__(self) -> int:
        return len(self.users) * (1 + self.negatives)

    def batch(self, indices: np.ndarray, epoch: int) -> tuple:
        which, slot = np.divmod(indices, 1 + self.negatives)
        users, items = self.users[which], self.items[which].copy()
        negative = np.flatnonzero(slot > 0)
        items[negative] = sample_negatives(users[negative], indices[negative], self.seed, epoch, self.positives)
        labels = torch.from_numpy((slot == 0).astype(np.float32))
        return (torch.from_numpy(users), torch.from_numpy(items)), labels


class RankedCandidates:
    """Validation for implicit feedback: each held-out positive with ``negatives`` items the user
    never rated (fixed for the run), and every candidate's training popularity (the baseline).
    Batches are ``(users, candidates), popularity`` with the positive in column 0."""

    def __init__(self, users: np.ndarray, items: np.ndarray, negatives: int, positives: PairSet, seed: int,
                 popularity: np.ndarray):
        self.users, self.items, self.negatives, self.positives, self.seed = users, items, negatives, positives, seed
        self.popularity = torch.from_numpy(popularity.astype(np.float64))

    def __len__(self) -> int:
        return len(self.users)

    def batch(self, indices: np.ndarray, epoch: int) -> tuple:
        users = self.users[indices]
        keys = indices[:, None] * self.negatives + np.arange(self.negatives)[None, :]
        repeated = np.repeat(users, self.negatives)
        negatives = sample_negatives(repeated, keys.reshape(-1), self.seed, VALIDATION_EPOCH, self.positives)
        candidates = np.concatenate([self.items[indices][:, None], negatives.reshape(len(indices), -1)], axis=1)
        candidates_t = torch.from_numpy(candidates)
        return (torch.from_numpy(users), candidates_t), self.popularity[candidates_t]
