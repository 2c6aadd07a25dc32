"""The Horovod-aware sampler: one global order per epoch, split across ranks, resumable anywhere."""

from __future__ import annotations

import math
import random
import threading
from typing import Callable, Iterator, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from .image.resolution import RESOLUTION

SEED_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)
CHUNK = 4096  # samples turned into Python tuples (and seeds) at a time by the iterator
# Below this many samples an epoch's order takes a few ms (randperm of 131,072: 2-5 ms here): it is
# drawn when needed, not ahead on a thread.
PREFETCH_MIN_SAMPLES = 1 << 17


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


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The epoch's permutation of all indices, from ``seed + epoch`` (the same for every number of ranks)."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    # int32 where it fits: half the memory, and the same permutation (randperm draws the same
    # random numbers whatever the dtype; tests/unit/test_sampler_scale.py checks it).
    dtype = torch.int32 if num_samples < 2**31 else torch.int64
    return torch.randperm(num_samples, generator=generator, dtype=dtype).numpy()


class ShareKey(NamedTuple):
    """Everything a rank's share of an epoch depends on (see ``rank_share``)."""
    num_samples: int
    replicas: int
    rank: int
    seed: int
    shuffle: bool
    pad: bool
    epoch: int
    start: int


def rank_share(key: ShareKey) -> np.ndarray:
    """One rank's dataset indices for the rest of an epoch (int64), from global position ``start``:
    positions ``start + rank``, ``start + rank + replicas``, ... of the epoch's order, then (with
    ``pad``) the order again from its beginning until every rank has as many. The permutation
    is freed on return: only the share (1/replicas of it) is kept."""
    order = epoch_order(key.num_samples, key.seed, key.epoch, key.shuffle)
    total, replicas = len(order), key.replicas
    rest = max(0, total - key.start)
    taken = order[key.start + key.rank::replicas] if rest else order[:0]
    if not (key.pad and total):
        return taken.astype(np.int64)
    padded = np.arange(key.rank + len(taken) * replicas, rest + (-rest % replicas), replicas)
    share = np.empty(len(taken) + len(padded), dtype=np.int64)  # filled in place: no int32 copy between
    share[:len(taken)] = taken
    share[len(taken):] = order[(padded - rest) % total]
    return share


class ShareDraw:
    """A rank's share of one epoch, drawn on a thread of its own before the epoch asks for it.

    ``torch.randperm`` (a sequential Fisher-Yates: 0.28 s at 14.2M samples on a quiet 2-core host,
    seconds on a busy one) and numpy's copies release the GIL, so training goes on meanwhile. The
    share is a pure function of its key, so ``take`` returns the very array a draw in the caller's
    thread would: timing decides only when it is ready. The thread ends with its draw; nothing is left running.
    """

    def __init__(self, key: ShareKey):
        self.key = key
        self.share: np.ndarray | None = None
        self.thread = threading.Thread(target=self._draw, name=f"hvdtrain-sampler-epoch-{key.epoch}")
        self.thread.start()

    def _draw(self) -> None:
        try:
            self.share = rank_share(self.key)
        except Exception:  # noqa: BLE001 -- take() draws again in the caller's thread, where an error shows
            self.share = None

    def wait(self) -> None:
        self.thread.join()

    def take(self) -> np.ndarray:
        self.wait()
        return self.share if self.share is not None else rank_share(self.key)


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

    Shares are drawn ahead on a thread (``ShareDraw``, for ``PREFETCH_MIN_SAMPLES`` samples or
    more): from ``set_epoch`` on, and, once an epoch's share is taken (``index_array``, ``iter``),
    the next epoch's from its position 0, so that the next epoch starts without waiting for
    ``torch.randperm``. A share asked for before its draw ends waits for it; one never drawn
    ahead (``set_epoch`` not called, or the sampler changed) is drawn in the caller's thread.
    Either way the array is the same.
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
        self._handed: tuple[ShareKey, np.ndarray] | None = None  # the share last taken
        self._drawing: ShareDraw | None = None  # the share being drawn ahead, on its thread

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handed"] = state["_drawing"] = None  # a thread does not travel: a copy draws its own
        return state

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.epoch = epoch
        self.start = start
        # Drawn from now on (if not drawn ahead already): training sets the epoch before it starts
        # the loader, whose first start (forkserver workers, seconds) then hides the draw.
        self.draw_ahead(self.share_key(epoch, start))

    def draw_ahead(self, key: ShareKey) -> None:
        """Start drawing ``key``'s share on a thread, unless it is taken or under way already, or
        the dataset is small enough for a draw when needed (``PREFETCH_MIN_SAMPLES``)."""
        if not (self.shuffle and self.num_samples_total >= PREFETCH_MIN_SAMPLES):
            return
        taken, drawing = self._handed, self._drawing
        if (taken is not None and taken[0] == key) or (drawing is not None and drawing.key == key):
            return
        if self._drawing is not None:  # drawn for another epoch or position: never two orders in memory at once
            self._drawing.wait()
        self._drawing = ShareDraw(key)

    def global_order(self) -> np.ndarray:
        """The epoch's permutation of all indices (the same for every number of ranks)."""
        return epoch_order(self.num_samples_total, self.seed, self.epoch, self.shuffle)

    def share_key(self, epoch: int, start: int) -> ShareKey:
        """What this rank's share of ``epoch`` from global position ``start`` depends on."""
        return ShareKey(self.num_samples_total, self.num_replicas, self.rank, self.seed, self.shuffle, self.pad,
                        epoch, start)

    def index_array(self) -> np.ndarray:
        """This rank's dataset indices for the rest of the epoch (``rank_share``, int64), from global
        position ``start``. The array is shared with every caller of the same epoch and position
        (the elastic sample log, then the loader): read it, do not write it."""
        key = self.share_key(self.epoch, self.start)
        if self._handed is not None and self._handed[0] == key:
            return self._handed[1]
        self._handed = None
        drawing, self._drawing = self._drawing, None
        if drawing is not None and drawing.key == key:
            share = drawing.take()
        else:
            if drawing is not None:  # drawn for another epoch or position: never two orders in memory at once
                drawing.wait()
            share = rank_share(key)
        self._handed = (key, share)
        self.draw_ahead(self.share_key(self.epoch + 1, 0))
        return share

    def indices(self) -> list[int]:
        """``index_array()`` as a list (e.g. for JSON); the sampler itself never builds one."""
        return self.index_array().tolist()

    def __iter__(self) -> Iterator[tuple[int, ...]]:
        # The epoch's share is taken now (as set_epoch left it); the tuples and their augmentation
        # seeds are made a chunk at a time, so the epoch's first sample does not wait for all seeds.
        size = self.resolution(self.epoch) if self.resolution is not None else None
        return self.pairs(self.index_array(), self.seed, self.epoch, size)

    @staticmethod
    def pairs(indices: np.ndarray, seed: int, epoch: int, size: int | None) -> Iterator[tuple[int, ...]]:
        for first in range(0, len(indices), CHUNK):
            chunk = indices[first:first + CHUNK]
            pairs = zip(chunk.tolist(), sample_seeds(seed, epoch, chunk).tolist())
            if size is None:
                yield from pairs
            else:  # a third element: the epoch's training resolution (progressive resizing)
                yield from ((index, sample, size) for (index, sample) in pairs)

    def __len__(self) -> int:
        remaining = max(0, self.num_samples_total - self.start)
        if self.pad:
            return math.ceil(remaining / self.num_replicas)
        return len(range(self.rank, remaining, self.num_replicas))


class SeededSamples(Dataset):
    """Wraps a dataset so that ``dataset[(index, seed)]`` runs its transform under ``seed``.

    torchvision's random transforms draw from the global torch (and Python) generators; they are
    seeded per sample. In the training process (no loader workers) the caller's streams (dropout,
    say) are restored afterwards; a loader worker's streams serve nothing else, so a worker skips
    the restore. Only torch's CPU generator is seeded: ``torch.manual_seed`` also seeds every CUDA
    device, and with ``fork_rng`` it made this wrapper 35-100x the cost of loading an 8x8 sample;
    the CPU draws are the same. ``python benchmarks/seeding_cost.py`` (us per sample of in-memory
    8x8 digits, 2-core AMD EPYC under a load of 14, three runs): a plain index 10-17, this wrapper
    33-46 in a worker and 86-107 in the training process, 807-1695 before. A dataset that draws no
    random numbers needs none of it: ``IndexedSamples``.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]):
        index, seed = key[0], key[1]
        # A third element is the epoch's training resolution (progressive resizing).
        token = RESOLUTION.set(key[2]) if len(key) > 2 else None
        restore = get_worker_info() is None
        if restore:
            python_state, torch_state = random.getstate(), torch.get_rng_state()
        torch.default_generator.manual_seed(seed)
        random.seed(seed)
        try:
            return self.dataset[index]
        finally:
            if restore:
                random.setstate(python_state)
                torch.set_rng_state(torch_state)
            if token is not None:
                RESOLUTION.reset(token)


class IndexedSamples(Dataset):
    """Wraps a dataset whose samples draw no random numbers: ``dataset[(index, seed)]`` is
    ``dataset[index]``, at the cost of one tuple index (the sampler's seed is not needed)."""

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, ...]):
        return self.dataset[key[0]]
