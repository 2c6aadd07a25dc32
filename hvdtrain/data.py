"""Datasets, transforms, Horovod-aware samplers and loaders.

Images leave the loader workers as uint8 tensors (a quarter of the bytes of float32 through the
worker queues and the host-to-device copy); ``DeviceNormalizer`` converts and normalizes whole
batches on the training device.
"""

from __future__ import annotations

import math
import multiprocessing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Sampler
from torchvision import transforms

from .config import Config, DataConfig
from .file_index import DataError, FileIndex, shared_index
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
    """uint8 NCHW batch -> normalized float batch on the device, optionally channels_last."""

    def __init__(self, device: torch.device, channels_last: bool = False):
        self.device = device
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1) * 255

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        images = images.to(self.device, non_blocking=True)
        if images.dtype == torch.uint8:
            images = images.float().sub_(self.mean).div_(self.std)
        return images.contiguous(memory_format=self.memory_format)


class ShardedSampler(Sampler[int]):
    """The global order of an epoch, split across ranks.

    Every epoch draws one permutation of the whole dataset from ``seed + epoch`` (independent of
    the number of ranks). Rank ``r`` of ``n`` takes positions ``r, r + n, r + 2n, ...``, so that the
    k-th batches of all ranks together are exactly the k-th global batch of ``n x batch`` images a
    single process would draw. With ``pad`` the order is extended by wrapping around so that every
    rank gets the same number of samples (training); without it no index is repeated and every
    index belongs to exactly one rank (validation).
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

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def global_order(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.num_samples_total, generator=generator).tolist()
        else:
            order = list(range(self.num_samples_total))
        if self.pad and order:
            padded = math.ceil(len(order) / self.num_replicas) * self.num_replicas
            order = (order * math.ceil(padded / len(order)))[:padded]
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.global_order()[self.rank::self.num_replicas])

    def __len__(self) -> int:
        if self.pad:
            return math.ceil(self.num_samples_total / self.num_replicas)
        return len(range(self.rank, self.num_samples_total, self.num_replicas))


def loader_kwargs(data: DataConfig, pin_memory: bool) -> dict:
    kwargs: dict = {"num_workers": data.workers, "pin_memory": pin_memory}
    if data.workers > 0:
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
    train = CountingLoader(DataLoader(train_set, batch_size=batch, sampler=train_sampler, drop_last=True,
                                      collate_fn=collate, **kwargs), fail)
    val = CountingLoader(DataLoader(val_set, batch_size=batch, sampler=val_sampler, drop_last=False,
                                    collate_fn=collate, **kwargs), fail)
    return Loaders(train, val, train_sampler, num_classes, len(train_set), len(val_set), index)
