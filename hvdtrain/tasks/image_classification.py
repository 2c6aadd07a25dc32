"""Image classification (ImageNet-style): the default task.

Data: an ImageFolder tree (``data.dir`` with ``train/`` and ``val/``), the built-in demo dataset
when ``data.dir`` is empty, or synthetic batches. Model: any torchvision classification model.
Loss: cross-entropy (label smoothing in training), or binary cross-entropy (``optim.loss=bce``).
Metrics: loss, top-1 and top-5 accuracy, from exact sums of correct predictions over every
validation image once.

Recipes (docs/recipes.md): per-image policies and random erasing in the loader workers
(data/image/policies.py), progressive resizing through the sampler, mixup/cutmix on the device
(data/image/mixing.py; training top-1 then counts the dominant label of each mixed image), and
test-time flip averaging (``eval.flip``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from ..config import Config, ConfigError
from ..data.demo import ensure_demo_dataset
from ..data.files.file_list import host_budget
from ..data.files.index import FileIndex
from ..data.files.shared_index import shared_index
from ..data.files.val_split import shared_split
from ..data.image.device_decode import DeviceDecoder, EncodedBatch, choose, plan_transforms
from ..data.image.folder import CountingLoader, ImageFiles, collate
from ..data.image.mixing import BatchMix
from ..data.image.resolution import epoch_resolution
from ..data.image.transforms import DeviceNormalizer, fast_eval_transform, fast_train_transform
from ..data.loaders import Loaders, index_cache_dir, loader_kwargs
from ..data.sampler import SeededSamples, ShardedSampler
from ..data.synthetic import SyntheticBatches
from ..model.build import build_model
from . import DataEnv, Task

SUM_FIELDS = ("loss_sum", "correct1", "correct5", "count")


def hit_counts(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 and top-5 hits in a batch as 0-d tensors on the batch's device (no host sync).

    Top-k is capped by the number of classes. Soft targets (mixup/cutmix) count their dominant label.
    """
    if targets.ndim == 2:
        targets = targets.argmax(dim=1)
    k = min(5, logits.shape[1])
    hits = logits.topk(k, dim=1).indices.eq(targets.view(-1, 1))
    return hits[:, :1].sum(), hits.sum()


def bce_loss(logits: torch.Tensor, targets: torch.Tensor, smoothing: float = 0.0,
             threshold: float = 0.0) -> torch.Tensor:
    """timm's ``BinaryCrossEntropy`` as ResNet strikes back trains with it: one-hot (or mixed soft)
    targets smoothed to ``t * (1 - smoothing) + smoothing / classes`` (timm's ``mixup_target``), set
    to 0 or 1 by ``threshold`` when it is above 0, then binary cross-entropy with logits averaged
    over images and classes. Half-precision logits are scored in float32."""
    classes = logits.shape[1]
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if not targets.is_floating_point():
        targets = F.one_hot(targets, classes)
    targets = targets.to(logits.dtype) * (1 - smoothing) + smoothing / classes
    if threshold > 0:
        targets = targets.gt(threshold).to(logits.dtype)
    return F.binary_cross_entropy_with_logits(logits, targets)


def summarize(sums: torch.Tensor) -> dict[str, float]:
    """Global loss mean, top-1 and top-5 (percent) and the image count from summed values."""
    loss_sum, correct1, correct5, count = (float(v) for v in sums)
    if count == 0:
        return {"loss": float("nan"), "top1": float("nan"), "top5": float("nan"), "samples": 0}
    return {"loss": loss_sum / count, "top1": 100.0 * correct1 / count, "top5": 100.0 * correct5 / count,
            "samples": int(round(count))}


def file_datasets(data, root: Path, is_primary: bool = True, broadcast_object=None, augment=None,
                  run_dir: Path | None = None, seed: int = 0, transforms: tuple | None = None,
                  allgather=None, share: str = "private") -> tuple[ImageFiles, ImageFiles, FileIndex]:
    """The train and val datasets over rank 0's (cached) file index; with ``data.val_fraction``,
    val is the part of train/ recorded in ``run_dir`` (data/files/val_split.py; ``share``: the run
    folder's output.share). ``transforms``: (train, val) instead of the CPU pipeline's (e.g. the
    device decoder's planning transforms)."""
    splits = ("train",) if data.val_fraction > 0 else ("train", "val")
    index = shared_index(root, index_cache_dir(data), is_primary, broadcast_object, splits, allgather)
    val_dir = root / "val"
    if data.val_fraction > 0:
        index, note = shared_split(index, data.val_fraction, seed, Path(run_dir or "."), is_primary,
                                   broadcast_object, share)
        index.note = note
        val_dir = root / "train"
    train_transform, val_transform = transforms or (fast_train_transform(data, augment), fast_eval_transform(data))
    train_set = ImageFiles(root / "train", index.train.paths, index.train.labels, train_transform, replace_bad=True)
    val_set = ImageFiles(val_dir, index.val.paths, index.val.labels, val_transform, replace_bad=False)
    return train_set, val_set, index


def dataset_root(cfg: Config, env: DataEnv) -> Path:
    """``data.dir``, or the built-in demo dataset: generated once per host (the generation ends in an
    atomic rename, so processes that race without collectives are safe too)."""
    if cfg.data.dir:
        return Path(cfg.data.dir).expanduser()
    with env.local_rank_zero_first():
        return ensure_demo_dataset()


def uses_shards(data) -> bool:
    """data.format=shards, or auto with a manifest.json in data.dir (or a URL)."""
    if data.format == "auto" and data.dir:
        from ..data.shards.manifest import has_manifest

        return has_manifest(data.dir)
    return data.format == "shards"


class ImageClassification(Task):
    name = "image_classification"
    sum_fields = SUM_FIELDS
    metric_directions = {"loss": "min", "top1": "max", "top5": "max"}
    best_metric = "top1"
    higher_is_better = True
    unit = "img"

    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.num_classes = cfg.model.num_classes or 1000
        self.index: FileIndex | None = None
        # the shard loader's position in the epoch (data/shards/loader.py), with data.format=shards
        self.shard_stream = None
        self.normalizers: dict[tuple, DeviceNormalizer] = {}
        self.device_decoder: DeviceDecoder | None = None  # data.decoder=nvimgcodec (data/image/device_decode.py)
        augment = cfg.augment
        self.mix = BatchMix(augment.mixup_alpha, augment.cutmix_alpha, augment.mix_prob, augment.switch_prob,
                            self.num_classes)

    def build_loaders(self, env: DataEnv) -> Loaders:
        cfg = self.cfg
        data, batch, rank, world_size = cfg.data, cfg.train.batch_size, env.rank, env.world_size
        if data.synthetic:
            per_rank = data.synthetic_samples // world_size
            train = SyntheticBatches(per_rank // batch, batch, data.image_size, self.num_classes, cfg.seed + rank)
            # ImageNet's proportion of validation samples (50000 for 1281167), so a short synthetic
            # epoch is not followed by a long validation.
            val_samples = round(data.synthetic_samples * 50000 / 1281167)
            val = SyntheticBatches(max(1, val_samples // world_size // batch), batch,
                                   data.val_image_size or data.image_size, self.num_classes, cfg.seed + 7919 + rank)
            return Loaders(train, val, None, per_rank * world_size, 0)

        transforms = self.decoding(env)
        if uses_shards(data):
            return self.shard_loaders(env, transforms)
        root = dataset_root(cfg, env)
        train_set, val_set, self.index = file_datasets(data, root, rank == 0, env.broadcast_object, cfg.augment,
                                                       Path(cfg.output.dir), cfg.seed, transforms, env.allgather,
                                                       cfg.output.share)
        self.num_classes = cfg.model.num_classes or len(self.index.train.classes)
        self.mix.num_classes = self.num_classes
        train_sampler = ShardedSampler(len(train_set), world_size, rank, seed=cfg.seed, shuffle=True, pad=True,
                                       resolution=epoch_resolution(data) if data.augment else None)
        val_sampler = ShardedSampler(len(val_set), world_size, rank, shuffle=False, pad=False)
        kwargs = loader_kwargs(data, env.pin_memory)
        fail = data.on_bad_file == "fail"
        # A private generator: creating an iterator must not consume the global torch RNG, or a run
        # resumed mid-epoch would see different random numbers than an uninterrupted one.
        # The last partial batch is kept with train.drop_last=false (the sampler's padding gives every
        # rank the same number), and always in elastic runs: after a change in the number of ranks the
        # rest of an epoch need not be a whole number of global batches, and no image may be left out.
        train = CountingLoader(DataLoader(SeededSamples(train_set), batch_size=batch, sampler=train_sampler,
                                          drop_last=not env.keep_partial_batches, collate_fn=collate,
                                          generator=torch.Generator().manual_seed(cfg.seed), **kwargs), fail)
        val = CountingLoader(DataLoader(SeededSamples(val_set), batch_size=batch, sampler=val_sampler,
                                        drop_last=False, collate_fn=collate,
                                        generator=torch.Generator().manual_seed(cfg.seed), **kwargs), fail)
        # Persistent workers: the training and the validation loader each keep data.workers.
        budget = host_budget(env.ranks_on_host, 2, data.workers, self.index.nbytes, self.index.sharing())
        return Loaders(train, val, train_sampler, len(train_set), len(val_set), val_sampler,
                       note="; ".join(filter(None, [self.index_note(), self.decoding_note(), budget])))

    def decoding(self, env: DataEnv) -> tuple | None:
        """``data.decoder``: None for the CPU pipeline, else the planning transforms of the device
        decoder, which is made here (a missing library stops before any loader starts)."""
        data = self.cfg.data
        # The validation resize filter of the device decoder is bilinear: data.val_interpolation=bicubic
        # keeps the CPU path under data.decoder=auto (validate() refuses it with nvimgcodec).
        if choose(data.decoder, env.device) == "cpu" or data.val_interpolation != "bilinear":
            return None
        transforms = plan_transforms(data, self.cfg.augment)
        threads = max(1, torch.get_num_threads()) if env.device.type == "cpu" else 2
        self.device_decoder = DeviceDecoder(env.device, data.max_image_pixels, threads)
        return transforms

    def decoding_note(self) -> str:
        if self.device_decoder is not None:
            return self.device_decoder.describe()
        return "JPEG decoding: libjpeg-turbo in the loader workers" + \
            (" (data.decoder=nvimgcodec decodes on the GPU: make setup EXTRAS=gpudecode)"
             if self.cfg.data.decoder == "auto" and torch.cuda.is_available() else "")

    def shard_loaders(self, env: DataEnv, transforms: tuple | None = None) -> Loaders:
        """Loaders over ``hvdtrain prepare``'s tar shards (data/shards/loader.py), local or at a URL."""
        from ..data.shards import loader as shards
        from ..data.shards.manifest import read_manifest

        cfg, data = self.cfg, self.cfg.data
        if env.keep_partial_batches:
            raise ConfigError("elastic.enabled=true does not read shards yet: use data.format=folder"
                              if cfg.elastic.enabled else "train.drop_last=false does not apply to tar shards (each "
                              "rank reads its own shards and leaves its remainder out): set train.drop_last=true, "
                              "or use data.format=folder")
        manifest = read_manifest(data.dir)
        self.num_classes = cfg.model.num_classes or len(manifest.classes)
        train, val, stream = shards.shard_loaders(
            manifest, env.rank, env.world_size, cfg.train.batch_size,
            *(transforms or (fast_train_transform(data, cfg.augment), fast_eval_transform(data))), cfg.seed,
            data.shuffle_buffer, data.on_bad_file == "fail",
            loader_kwargs(data, env.pin_memory), DataLoader, epoch_resolution(data) if data.augment else None)
        self.shard_stream = stream
        return Loaders(train, val, stream, manifest.train.size, manifest.val.size,
                       note="; ".join(filter(None, [shards.describe(manifest), self.decoding_note()])))

    def index_note(self) -> str:
        index = self.index
        if index is None:
            return ""
        return (f"file index of {index.root} from {index.source} in {index.seconds:.2f}s"
                + (f"; {index.note}" if index.note else ""))

    def build_model(self) -> torch.nn.Module:
        return build_model(self.cfg.model, self.num_classes)

    def to_device(self, batch: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        images, targets = batch
        if isinstance(images, EncodedBatch):  # data.decoder=nvimgcodec: decoded here, on the device
            images, positions = self.device_decoder(images)
            if len(positions) != len(targets) or positions != list(range(len(targets))):
                targets = targets[positions]
        # channels_last suits convolutions on the GPU (tensor cores); on the CPU it is slower here.
        key = (device, dtype)
        if key not in self.normalizers:
            self.normalizers[key] = DeviceNormalizer(device, channels_last=device.type == "cuda", dtype=dtype)
        return self.normalizers[key](images), targets.to(device, non_blocking=True)

    def augment_batch(self, inputs: Any, targets: torch.Tensor, seed: int) -> tuple[Any, torch.Tensor]:
        if not self.mix.enabled:
            return inputs, targets
        return self.mix(inputs, targets, seed)

    def predict(self, model: torch.nn.Module, inputs: Any) -> torch.Tensor:
        outputs = model(inputs)
        if self.cfg.eval.flip:
            # Test-time augmentation: the mean of the logits of the image and its mirror image.
            outputs = (outputs + model(inputs.flip(-1))) / 2
        return outputs

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, training: bool) -> torch.Tensor:
        if targets.is_floating_point():
            # Soft targets (mixup/cutmix): cross_entropy smooths each one-hot part, as timm's mixup_target.
            targets = targets.to(torch.promote_types(outputs.dtype, torch.float32))
        if training and self.cfg.optim.loss == "bce":
            return bce_loss(outputs, targets, self.cfg.optim.label_smoothing, self.cfg.optim.bce_target_threshold)
        if training:
            return F.cross_entropy(outputs, targets, label_smoothing=self.cfg.optim.label_smoothing)
        # Half-precision logits (autocast) are scored in float32; float32 and float64 as they are.
        return F.cross_entropy(outputs.to(torch.promote_types(outputs.dtype, torch.float32)), targets)

    def metric_sums(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        top1, top5 = hit_counts(outputs, targets)
        count = targets.shape[0]
        return torch.stack([loss.detach().double() * count, top1.double(), top5.double(),
                            torch.tensor(float(count), dtype=torch.float64, device=targets.device)])

    def summarize(self, sums: torch.Tensor) -> dict[str, float]:
        return summarize(sums)

    def describe(self, loaders: Loaders) -> str:
        data = "synthetic data" if self.cfg.data.synthetic else \
            f"{loaders.train_size} train / {loaders.val_size} val images"
        return f"{self.cfg.model.arch} with {self.num_classes} classes, {data}"

    def epoch_summary(self, train: dict[str, Any], val: dict[str, Any]) -> str:
        ema = f", ema top1 {val['ema_top1']:.2f}% top5 {val['ema_top5']:.2f}%" if "ema_top1" in val else ""
        return (f"train loss {train['loss']:.4f} top1 {train['top1']:.2f}%  "
                f"| val loss {val['loss']:.4f} top1 {val['top1']:.2f}% top5 {val['top5']:.2f}%{ema}")

    def state_components(self) -> dict[str, Any]:
        return {} if self.shard_stream is None else {"shard_loader": self.shard_stream}

    def checkpoint_metadata(self) -> dict[str, Any]:
        # The class folders, in label order: a resume where one has vanished stops (resume.resume).
        classes = {"classes": list(self.index.train.classes)} if self.index is not None else {}
        return {"arch": self.cfg.model.arch, "num_classes": self.num_classes, **classes}

    def bench_batches(self, count: int, rank: int) -> SyntheticBatches:
        cfg = self.cfg
        return SyntheticBatches(count, cfg.train.batch_size, cfg.data.image_size, self.num_classes, cfg.seed + rank)
