"""Datasets, transforms, Horovod-aware samplers and loaders.

Images leave the loader workers as uint8 tensors (a quarter of the bytes of float32 through the
worker queues and the host-to-device copy); ``DeviceNormalizer`` converts and normalizes whole
batches on the training device.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torchvision import transforms

from .config import Config, DataConfig
from .file_index import DataError, FileIndex, shared_index  # noqa: F401 - DataError is re-exported
from .folder_data import CountingLoader, ImageFiles, collate
from .imaging import CenterCrop, TrainCrop, Transform

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def val_resize_size(data: DataConfig) -> int:
    return data.val_resize or int(round(data.image_size / 0.875))


def fast_train_transform(data: DataConfig) -> Transform:
    """Encoded bytes -> uint8 crop; the same augmentation as ``train_transform``, decoded faster."""
    return TrainCrop(data.image_size) if data.augment else fast_eval_transform(data)


def fast_eval_transform(data: DataConfig) -> Transform:
    return CenterCrop(data.image_size, val_resize_size(data))


def train_transform(data: DataConfig) -> transforms.Compose:
    if not data.augment:
        return eval_transform(data)
    return transforms.Compose([
        transforms.RandomResizedCrop(data.image_size),
        transforms.RandomHorizontalFlip(),
        transforms.PILToTensor(),
    ])


def eval_transform(data: DataConfig) -> transforms.Compose:
    return transforms.Compose([
        transforms.Resize(val_resize_size(data)),
        transforms.CenterCrop(data.image_size),
        transforms.PILToTensor(),
    ])


class DeviceNormalizer:
    """uint8 NCHW batch -> normalized ``dtype`` batch on the device, optionally channels_last."""

    def __init__(self, device: torch.device, channels_last: bool = False, dtype: torch.dtype = torch.float32):
        self.device, self.dtype = device, dtype
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor(IMAGENET_MEAN, device=device, dtype=dtype).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=device, dtype=dtype).view(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.to(self.dtype).sub_(self.mean).div_(self.std)
        elif images.dtype != self.dtype:
            images = images.to(self.dtype)
        return images.contiguous(memory_format=self.memory_format)


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
                 shuffle: bool = True, pad: bool = True):
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

    def __iter__(self) -> Iterator[tuple[int, int]]:
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

    def __getitem__(self, key: tuple[int, int]):
        index, seed = key
        python_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                return self.dataset[index]
            finally:
                random.setstate(python_state)


def init_worker(worker_id: int, trainer_pid: int) -> None:
    """Set up a loader worker.

    Workers leave SIGTERM/SIGUSR1 to the training process, which stops at a step boundary and
    checkpoints; a worker killed by the same signal would fail the next batch first. In exchange
    a worker must not outlive the training process: forkserver workers are children of the fork
    server, not of the trainer, so PyTorch's parent check does not see the trainer die.
    """
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)

    def exit_with_trainer() -> None:
        while True:
            time.sleep(2.0)
            try:
                os.kill(trainer_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass

    threading.Thread(target=exit_with_trainer, name="hvdtrain-orphan-check", daemon=True).start()


def shutdown_workers(*loaders: object) -> None:
    """Stop persistent loader workers now rather than at interpreter exit."""
    for loader in loaders:
        loader = getattr(loader, "loader", loader)  # CountingLoader wraps a DataLoader
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


def loader_kwargs(data: DataConfig, pin_memory: bool) -> dict:
    kwargs: dict = {"num_workers": data.workers, "pin_memory": pin_memory}
    if data.workers > 0:
        kwargs["worker_init_fn"] = functools.partial(init_worker, trainer_pid=os.getpid())
        kwargs["persistent_workers"] = True
        kwargs["prefetch_factor"] = data.prefetch_factor
        # Forking a process that has initialized MPI/NCCL/CUDA is unsafe; forkserver forks from a
        # clean server process instead (as Horovod's ImageNet example does).
        if data.mp_context in multiprocessing.get_all_start_methods():
            kwargs["multiprocessing_context"] = data.mp_context
    return kwargs


@dataclass
class Loaders:
    train: Sequence | DataLoader
    val: Sequence | DataLoader
    train_sampler: ShardedSampler | None
    num_classes: int
    train_size: int
    val_size: int
    index: FileIndex | None = None
    val_sampler: ShardedSampler | None = None

    def reshard(self, rank: int, world_size: int) -> None:
        """After the number of ranks changed (elastic training)."""
        for sampler in (self.train_sampler, self.val_sampler):
            if sampler is not None:
                sampler.rank, sampler.num_replicas = rank, world_size


class SyntheticBatches:
    """One random uint8 batch, yielded ``steps`` times: the input pipeline costs nothing."""

    def __init__(self, steps: int, batch_size: int, image_size: int, num_classes: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randint(0, 256, (batch_size, 3, image_size, image_size), dtype=torch.uint8,
                                    generator=generator)
        self.labels = torch.randint(0, num_classes, (batch_size,), generator=generator)
        self.steps = steps

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for _ in range(self.steps):
            yield self.images, self.labels

    def __len__(self) -> int:
        return self.steps


def index_cache_dir(data: DataConfig) -> Path | None:
    from .demo_data import cache_root

    return cache_root() if data.index_cache else None


def file_datasets(data: DataConfig, root: Path, is_primary: bool = True,
                  broadcast_object: Callable[[Any], Any] | None = None) -> tuple[ImageFiles, ImageFiles, FileIndex]:
    """The train and val datasets over rank 0's (cached) file index."""
    index = shared_index(root, index_cache_dir(data), is_primary, broadcast_object)
    train_set = ImageFiles(root / "train", index.train.paths, index.train.labels, fast_train_transform(data),
                           replace_bad=True)
    val_set = ImageFiles(root / "val", index.val.paths, index.val.labels, fast_eval_transform(data),
                         replace_bad=False)
    return train_set, val_set, index


def build_loaders(cfg: Config, root: Path | None, rank: int, world_size: int, pin_memory: bool,
                  broadcast_object: Callable[[Any], Any] | None = None) -> Loaders:
    data, batch = cfg.data, cfg.train.batch_size
    if data.synthetic:
        num_classes = cfg.model.num_classes or 1000
        per_rank = data.synthetic_samples // world_size
        train = SyntheticBatches(per_rank // batch, batch, data.image_size, num_classes, cfg.seed + rank)
        val = SyntheticBatches(max(1, 50000 // world_size // batch), batch, data.image_size, num_classes,
                               cfg.seed + 7919 + rank)
        return Loaders(train, val, None, num_classes, per_rank * world_size, 0)

    assert root is not None
    train_set, val_set, index = file_datasets(data, root, rank == 0, broadcast_object)
    num_classes = cfg.model.num_classes or len(index.train.classes)
    train_sampler = ShardedSampler(len(train_set), world_size, rank, seed=cfg.seed, shuffle=True, pad=True)
    val_sampler = ShardedSampler(len(val_set), world_size, rank, shuffle=False, pad=False)
    kwargs = loader_kwargs(data, pin_memory)
    fail = data.on_bad_file == "fail"
    # A private generator: creating an iterator must not consume the global torch RNG, or a run
    # resumed mid-epoch would see different random numbers than an uninterrupted one.
    # Elastic runs keep the last partial batch: after a change in the number of ranks the rest of
    # an epoch need not be a whole number of global batches, and no image may be left out.
    train = CountingLoader(DataLoader(SeededSamples(train_set), batch_size=batch, sampler=train_sampler,
                                      drop_last=not cfg.elastic.enabled, collate_fn=collate,
                                      generator=torch.Generator().manual_seed(cfg.seed), **kwargs), fail)
    val = CountingLoader(DataLoader(SeededSamples(val_set), batch_size=batch, sampler=val_sampler, drop_last=False,
                                    collate_fn=collate, generator=torch.Generator().manual_seed(cfg.seed),
                                    **kwargs), fail)
    return Loaders(train, val, train_sampler, num_classes, len(train_set), len(val_set), index, val_sampler)
