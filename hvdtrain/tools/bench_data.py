"""``python -m hvdtrain bench-data``: the training input pipeline alone, in images per second.

It measures what the model's side of a DataLoader sees: read, decode, augment and collate into
the uint8 batch the training step consumes (normalization then happens on the device, batched).
With ``--compare`` the plain torchvision pipeline (PIL decode, RandomResizedCrop, flip, ToTensor,
Normalize, default collate) runs on the same files in the same process, round by round in
alternation so that drift of the machine (other jobs, frequency, caches) hits both alike.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from ..config import AugmentConfig, ConfigError
from ..data import DataError
from ..data.image.decode import IMAGENET_MEAN, IMAGENET_STD
from ..data.image.folder import ImageFiles, collate
from ..data.loaders import loader_kwargs
from ..job_config import load_config
from ..tasks.image_classification import file_datasets

DROP_CACHES = "/proc/sys/vm/drop_caches"


class ReferenceFiles(Dataset):
    """torchvision.datasets.ImageFolder's loading (PIL open + convert RGB) over the same files."""

    def __init__(self, files: ImageFiles, image_size: int):
        from torchvision import transforms

        self.files = files
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(image_size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ])

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with open(f"{self.files.split_dir}/{self.files.paths[index]}", "rb") as handle:
            image = Image.open(handle).convert("RGB")
        return self.transform(image), self.files.labels[index]


def photo(rng: np.random.Generator, width: int = 500, height: int = 375) -> Image.Image:
    """A photo-like picture: smooth structure at several scales plus fine texture and sensor noise.

    At JPEG quality 90 these are ~90 KB at 500x375, like ImageNet's photos, so that decoding
    costs what it costs on real data (flat colours decode several times faster).
    """
    image = np.zeros((height, width, 3), np.float32)
    for cells, amplitude in ((4, 70), (16, 45), (64, 35), (250, 45)):
        small = rng.normal(0, 1, (max(2, cells * height // width), cells, 3)).astype(np.float32)
        small = ((small - small.min()) / (np.ptp(small) + 1e-6) * 255).astype(np.uint8)
        smooth = np.asarray(Image.fromarray(small).resize((width, height), Image.Resampling.BICUBIC), np.float32)
        image += (smooth - 128) / 128 * amplitude
    image += 128 + rng.normal(0, 13, image.shape)
    return Image.fromarray(np.clip(image, 0, 255).astype(np.uint8))


def make_photo_dataset(root: Path, train_images: int, val_images: int, classes: int = 10, seed: int = 0) -> None:
    """``root/{train,val}/<class>/*.JPEG`` photo-like 500x375 JPEGs at quality 90."""
    rng = np.random.default_rng(seed)
    for split, count in (("train", train_images), ("val", val_images)):
        for i in range(count):
            folder = root / split / f"class_{i % classes:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            photo(rng).save(folder / f"img_{i:06d}.JPEG", quality=90)


class FixedOrder(torch.utils.data.Sampler[int]):
    def __init__(self, order: list[int]):
        self.order = order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def run_round(iterator: Iterator, batches: int) -> tuple[int, float]:
    start = time.perf_counter()
    images = 0
    for _ in range(batches):
        batch = next(iterator)
        images += len(batch[0])
    return images, time.perf_counter() - start


class DeviceRounds:
    """data.decoder=nvimgcodec's two halves, timed apart: the loader side (read each file, plan its
    crop from the header: what the workers' cores do) and the device side (decode the batch's crop
    regions, resize, flip), with the CPU time the training process spends on the latter."""

    def __init__(self, loader: DataLoader, decoder):
        self.iterator, self.decoder = iter(loader), decoder
        self.decode_seconds = self.decode_cpu_seconds = 0.0
        self.decoded = 0

    def __next__(self):
        batch = next(self.iterator)
        device = self.decoder.device
        cpu, wall = time.process_time(), time.perf_counter()
        images, _ = self.decoder(batch[0])
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.decode_seconds += time.perf_counter() - wall
        self.decode_cpu_seconds += time.process_time() - cpu
        self.decoded += len(images)
        return batch

    def reset(self) -> None:
        self.decode_seconds = self.decode_cpu_seconds = 0.0
        self.decoded = 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdtrain bench-data", description="Images per second of the training input pipeline alone "
        "(read, decode, augment, collate to the uint8 batch the model consumes).",
        epilog="Per core, in this process (data.workers=0; runtime.threads=1 for one core). Example: python -m "
        "hvdtrain bench-data data.dir=/data/imagenet runtime.threads=1 --compare")
    parser.add_argument("--config", "-c", help="YAML config file or shipped config name")
    parser.add_argument("--compare", action="store_true", help="also run the plain torchvision pipeline, "
                        "interleaved, and print the ratio")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per pipeline (default 6)")
    parser.add_argument("--batches", type=int, default=4, help="batches per round (default 4)")
    parser.add_argument("--policies", action="store_true", help="also run every augment.policy (and "
                        "random erasing), interleaved, and print each one's images/s and its ratio to no policy")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="first write N photo-like 500x375 JPEGs (10 classes) into data.dir if it does not exist")
    parser.add_argument("--shards", action="append", default=[], metavar="DIR",
                        help="also read these shards (hvdtrain prepare's output of the same images), interleaved; "
                        "repeatable")
    parser.add_argument("--device-decode", action="store_true",
                        help="also run data.decoder=nvimgcodec's pipeline (on the GPU, or nvImageCodec's CPU backend "
                        "without one), interleaved: the workers' share (read and plan crops) and the device's "
                        "(decode, resize) apart, and the CPU cores each needs per 1,000 img/s")
    parser.add_argument("--cold", action="store_true",
                        help="drop the page cache before every timed round (Linux, root): reads come from the "
                        "disk, as in a first epoch over a dataset larger than memory")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_intermixed_args(argv)
    cfg = load_config(args.config, args.overrides)
    data = cfg.data
    if data.workers and any(item.split("=", 1)[0].strip() == "data.workers" for item in args.overrides):
        # Worker processes prefetch: a short timed round can take batches made before its clock
        # started (one such round reported 88,000 img/s). Per core, in this process, is exact.
        raise ConfigError(f"bench-data measures the pipeline per core, in its own process: use data.workers=0, "
                          f"not {data.workers} (with N workers on N free cores, a loader delivers up to N times that "
                          "rate)")
    data.workers = 0
    if args.cold and not os.access(DROP_CACHES, os.W_OK):
        raise ConfigError(f"--cold drops the page cache through {DROP_CACHES}, which only root can write on Linux")
    if not data.dir:
        raise DataError("bench-data needs data.dir=DIR (a train/ and val/ ImageFolder; --generate N makes one)")
    root = Path(data.dir).expanduser()
    if args.generate and not root.exists():
        make_photo_dataset(root, args.generate, max(10, args.generate // 10))
    threads = cfg.runtime.threads or 1
    torch.set_num_threads(threads)
    torch.manual_seed(cfg.seed)
    train_set, _, index = file_datasets(data, root)
    batch = cfg.train.batch_size
    needed = (args.rounds + 1) * args.batches * batch
    generator = torch.Generator().manual_seed(cfg.seed)
    order = torch.randperm(len(train_set), generator=generator).tolist()
    order = (order * (needed // max(1, len(order)) + 1))[:needed]
    kwargs = loader_kwargs(data, pin_memory=False)
    pipelines = {"hvdtrain": DataLoader(train_set, batch_size=batch, sampler=FixedOrder(order), drop_last=True,
                                        collate_fn=collate, **kwargs)}
    if args.compare:
        pipelines["reference"] = DataLoader(ReferenceFiles(train_set, data.image_size), batch_size=batch,
                                            sampler=FixedOrder(order), drop_last=True, **kwargs)
    if args.policies:
        for name, augment in policy_configs():
            policy_set, _, _ = file_datasets(data, root, augment=augment)
            pipelines[name] = DataLoader(policy_set, batch_size=batch, sampler=FixedOrder(order), drop_last=True,
                                         collate_fn=collate, **kwargs)
    for number, shard_dir in enumerate(args.shards):
        pipelines[f"shards{number + 1}"] = shard_batches(shard_dir, cfg)
    device_rounds = None
    if args.device_decode:
        from ..data.image.device_decode import DeviceDecoder, plan_transforms

        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        plan_train, _ = plan_transforms(data, cfg.augment)
        planned_set, _, _ = file_datasets(data, root, transforms=(plan_train, plan_train))
        device_rounds = DeviceRounds(DataLoader(planned_set, batch_size=batch, sampler=FixedOrder(order),
                                                drop_last=True, collate_fn=collate, **kwargs),
                                     DeviceDecoder(device, data.max_image_pixels, threads))
        pipelines["device"] = device_rounds
    cpu = cpu_name()
    print(f"bench-data: {root} ({len(train_set)} train images from {index.source}), crop {data.image_size}, "
          f"batch {batch}, workers {data.workers}, {threads} thread(s), {args.rounds} rounds x {args.batches} "
          f"batches; CPU {cpu}, {len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.2f}", flush=True)
    iterators = {name: loader if name == "device" else iter(loader) for name, loader in pipelines.items()}
    opened = count_opens()
    for name, iterator in iterators.items():  # warm-up: worker start, first file reads
        run_round(iterator, args.batches)
    if device_rounds is not None:
        device_rounds.reset()
    rates: dict[str, list[float]] = {name: [] for name in pipelines}
    totals = {name: [0, 0.0] for name in pipelines}
    for round_index in range(args.rounds):
        names = list(iterators) if round_index % 2 == 0 else list(reversed(iterators))
        for name in names:
            if args.cold:
                drop_page_cache()
            before = opened["total"]
            images, seconds = run_round(iterators[name], args.batches)
            opened[name] += opened["total"] - before
            rates[name].append(images / seconds)
            totals[name][0] += images
            totals[name][1] += seconds
        print(f"round {round_index + 1}: " + ", ".join(f"{name} {rates[name][-1]:.1f} img/s" for name in pipelines),
              flush=True)
    overall = {name: images / seconds for name, (images, seconds) in totals.items()}
    for name in pipelines:
        timed = totals[name][0]
        print(f"images_timed[{name}]={timed}")  # the work the rates stand for
        if name != "reference" and timed:
            print(f"files_opened_per_image[{name}]={opened[name] / timed:.4f}")
    if args.compare:
        ratios = [a / b for a, b in zip(rates["hvdtrain"], rates["reference"])]
        print(f"reference_images_per_sec={overall['reference']:.1f}")
        print(f"ratio={overall['hvdtrain'] / overall['reference']:.2f} (median of rounds "
              f"{statistics.median(ratios):.2f}, min {min(ratios):.2f}, max {max(ratios):.2f})")
    if args.policies:
        base = overall["hvdtrain"]
        for name in pipelines:
            if name.startswith("policy "):
                print(f"{name}: {overall[name]:.1f} img/s per {threads} thread(s) ({overall[name] / base:.2f} of "
                      f"the configured pipeline)", flush=True)
    for name, shard_dir in zip([n for n in pipelines if n.startswith("shards")], args.shards):
        print(f"{name}_images_per_sec={overall[name]:.1f} ({shard_dir}; ratio to hvdtrain on the folder "
              f"{overall[name] / overall['hvdtrain']:.2f}"
              + (f", to the reference {overall[name] / overall['reference']:.2f}" if args.compare else "") + ")")
    if device_rounds is not None:
        report_device(device_rounds, totals["device"][0], totals["device"][1], overall["hvdtrain"], threads)
    print(f"images_per_sec={overall['hvdtrain']:.1f}", flush=True)
    return 0


def report_device(rounds: DeviceRounds, images: int, seconds: float, cpu_rate: float, threads: int) -> None:
    """The device pipeline's two halves, and the CPU cores each takes per 1,000 images per second
    (against the CPU pipeline's ``cpu_rate``, images per second per ``threads``)."""
    decode_rate = rounds.decoded / max(rounds.decode_seconds, 1e-9)
    plan_rate = images / max(seconds - rounds.decode_seconds, 1e-9)
    cpu_per_image = rounds.decode_cpu_seconds / max(rounds.decoded, 1)
    workers_cores, main_cores = 1000 / plan_rate * threads, 1000 * cpu_per_image
    print(f"device_decode[{rounds.decoder.device}]: loader side (read, plan crops) {plan_rate:.1f} img/s per "
          f"{threads} thread(s); device side (decode, resize) {decode_rate:.1f} img/s, {1000 * cpu_per_image:.2f} ms "
          f"of the training process's CPU per image; images timed {rounds.decoded}")
    print(f"cores_per_1000_img_per_sec[device]={workers_cores + main_cores:.2f} (workers {workers_cores:.2f}, "
          f"training process {main_cores:.2f}); [cpu pipeline]={1000 / cpu_rate * threads:.2f}")
    print(f"device_decode_images_per_sec={decode_rate:.1f}")
    print(f"device_plan_images_per_sec={plan_rate:.1f}")


def drop_page_cache() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as handle:
        handle.write("1\n")  # the page cache (not dentries and inodes)


def policy_configs() -> list[tuple[str, AugmentConfig]]:
    """Every per-image policy at its default magnitude, and random erasing alone."""
    return [(f"policy {policy}", AugmentConfig(policy=policy)) for policy in
            ("trivialaugment", "randaugment", "autoaugment")] + [
        ("policy random_erase=0.25", AugmentConfig(random_erase=0.25))]


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def shard_batches(shard_dir: str, cfg) -> Iterator:
    """Endless training batches of one rank reading ``shard_dir`` (epoch after epoch), like training."""
    from ..data.image.transforms import fast_train_transform
    from ..data.shards import loader as shards
    from ..data.shards.manifest import read_manifest

    manifest = read_manifest(shard_dir)
    kwargs = loader_kwargs(cfg.data, pin_memory=False)
    loader, _, stream = shards.shard_loaders(manifest, 0, 1, cfg.train.batch_size, fast_train_transform(cfg.data),
                                             fast_train_transform(cfg.data), cfg.seed, cfg.data.shuffle_buffer,
                                             False, kwargs, DataLoader)

    class Epochs:
        def __iter__(self) -> Iterator:
            epoch = 0
            while True:
                stream.set_epoch(epoch)
                yield from loader
                epoch += 1

    return Epochs()


def count_opens() -> dict:
    """Counts the files the in-process pipelines open (with data.workers=0): per image for the folder,
    per shard for shards. ``total`` grows with every open."""
    import collections

    from ..data.image import folder as image_folder
    from ..data.shards import read as shard_reading

    counter: dict = collections.defaultdict(int)

    def counting(function):
        def wrapper(path):
            counter["total"] += 1
            return function(path)
        return wrapper

    image_folder.read_file = counting(image_folder.read_file)
    shard_reading.open_binary = counting(shard_reading.open_binary)
    return counter
