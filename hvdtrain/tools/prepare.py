"""``python -m hvdtrain prepare SRC DST``: an ImageFolder becomes WebDataset tar shards.

Layout of DST (the format ``hvdtrain/data/shards.py`` reads, and the ``webdataset`` library too):

    manifest.json                   classes, images per shard, totals, options, sha256 per shard,
                                    the source files that could not be read (skipped)
    train-000000.tar ...            {key}.jpg (or .png, ...) + {key}.cls (the label, ASCII digits)
    val-000000.tar ...

Keys are the image's position in its split's ImageFolder listing (``00001234``). Validation
records keep that order; training records are shuffled once with a fixed seed (ImageFolder order
is class by class), so shard contents are a pure function of the source and the options.

Safety and resume: each shard is written to ``.NAME.tmp-PID`` and renamed when complete, then a
sidecar ``.prepare/NAME.json`` (its image count and sha256) is renamed into place. A rerun after an
interruption keeps every shard whose sidecar is present and whose bytes still hash to it, and
writes the others again; the tar files are deterministic (fixed mtime, owner and member order), so
the result is byte-identical to an uninterrupted run. ``manifest.json`` is written last. A
destination holding anything that is not this tool's output (for the same source and options) is
refused.

Only Pillow, simplejpeg and the standard library are used: no torch, so workers start fast.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import multiprocessing
import os
import random
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..data.file_index import DataError, check_layout, scan_split

FORMAT = "hvdtrain-shards-v1"
MANIFEST = "manifest.json"
STATE_DIR = ".prepare"           # sidecars and the options of an unfinished run
OPTIONS_FILE = "options.json"
SPLITS = ("train", "val")
# Images re-encoded to estimate the output size per image when --max-side plans the shards.
ESTIMATE_SAMPLE = 32


class PrepareError(DataError):
    """A problem with prepare's arguments, source or destination, as one line."""


@dataclass
class Record:
    key: str
    path: str   # absolute source path
    label: int


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def member_ext(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def encode(path: str, max_side: int, quality: int) -> tuple[bytes, str]:
    """The bytes and extension stored for one source file.

    Without ``max_side`` (or when the image already fits) the original bytes, untouched; otherwise
    the image downscaled so that its longer side is ``max_side`` (Pillow's reducing draft + Lanczos),
    re-encoded as RGB JPEG at ``quality``. OSError: unreadable file; ValueError: not an image.
    """
    with open(path, "rb") as handle:
        data = handle.read()
    if not data:
        raise ValueError("empty file")
    if not max_side:
        return data, member_ext(path)
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            if max(image.size) <= max_side:
                image.verify()
                return data, member_ext(path)
            width, height = image.size
            scale = max_side / max(width, height)
            size = (max(1, round(width * scale)), max(1, round(height * scale)))
            image.draft("RGB", size)
            small = image.convert("RGB").resize(size, Image.Resampling.LANCZOS, reducing_gap=3.0)
        out = io.BytesIO()
        small.save(out, format="JPEG", quality=quality)
        return out.getvalue(), "jpg"
    except OSError as error:  # Pillow's UnidentifiedImageError, truncated data, ...
        raise ValueError(f"{type(error).__name__}: {error}") from None


def tar_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    """A member whose header does not depend on the machine, the user or the time."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_shard(job: tuple[str, str, list[Record], int, int]) -> dict:
    """Write one shard (temporary name, then rename) and its sidecar; returns the sidecar."""
    dst, name, records, max_side, quality = job
    final, state = Path(dst) / name, Path(dst) / STATE_DIR / f"{name}.json"
    scratch = Path(dst) / f".{name}.tmp-{os.getpid()}"
    skipped: list[str] = []
    images = 0
    with tarfile.open(scratch, "w", format=tarfile.USTAR_FORMAT) as tar:
        for record in records:
            try:
                data, ext = encode(record.path, max_side, quality)
            except (OSError, ValueError) as error:
                skipped.append(f"{record.path} ({getattr(error, 'strerror', None) or error})")
                continue
            for member, payload in ((f"{record.key}.{ext}", data), (f"{record.key}.cls", str(record.label).encode())):
                tar.addfile(*tar_member(member, payload))
            images += 1
    info = {"name": name, "images": images, "bytes": scratch.stat().st_size, "sha256": sha256_file(scratch),
            "skipped": skipped}
    os.replace(scratch, final)
    side = state.with_name(f"{state.name}.tmp-{os.getpid()}")
    side.write_text(json.dumps(info), encoding="utf-8")
    os.replace(side, state)
    return info


def finished(dst: Path, name: str, expected_records: int) -> dict | None:
    """The sidecar of a shard a previous run completed, when the shard still matches it."""
    try:
        info = json.loads((dst / STATE_DIR / f"{name}.json").read_text(encoding="utf-8"))
        ok = info["images"] + len(info["skipped"]) == expected_records and sha256_file(dst / name) == info["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return info if ok else None


def plan(records: list[Record], sizes: list[int], shard_bytes: int) -> list[list[Record]]:
    """Consecutive records, cut when the (estimated) bytes of a shard reach ``shard_bytes``."""
    shards: list[list[Record]] = [[]]
    total = 0
    for record, size in zip(records, sizes):
        if shards[-1] and total + size > shard_bytes:
            shards.append([])
            total = 0
        shards[-1].append(record)
        total += size
    return [shard for shard in shards if shard]


def estimated_sizes(records: list[Record], max_side: int, quality: int) -> list[int]:
    """Bytes per record in the shard: the file size, or with --max-side a fixed estimate from
    re-encoding the first images (deterministic: it depends on the source alone)."""
    sizes = []
    for record in records:
        try:
            sizes.append(os.stat(record.path).st_size + 1536)  # + two tar headers and padding
        except OSError:
            sizes.append(0)
    if not max_side:
        return sizes
    sample = []
    for record in records[:ESTIMATE_SAMPLE]:
        try:
            sample.append(len(encode(record.path, max_side, quality)[0]) + 1536)
        except (OSError, ValueError):
            pass
    mean = sum(sample) / len(sample) if sample else 1024
    return [int(mean)] * len(records)


def check_destination(dst: Path, options: dict) -> None:
    """Refuse a non-empty destination that is not an unfinished or finished run with these options."""
    if not dst.exists():
        return
    if not dst.is_dir():
        raise PrepareError(f"destination {dst} is a file (give a new or empty folder)")
    entries = os.listdir(dst)
    if not entries:
        return
    for marker in (dst / MANIFEST, dst / STATE_DIR / OPTIONS_FILE):
        try:
            previous = json.loads(marker.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if previous.get("format") == FORMAT and previous.get("options") == options:
            return
        raise PrepareError(f"destination {dst} holds shards prepared with other options "
                           f"({previous.get('options')}); give a new folder or delete it")
    raise PrepareError(f"destination {dst} is not empty and holds no hvdtrain prepare output "
                       f"({len(entries)} entries, e.g. {sorted(entries)[0]}): give a new or empty folder")


def prepare(src: Path, dst: Path, shard_size_mb: float = 256.0, max_side: int = 0, quality: int = 90,
            workers: int = 1, progress: bool = True) -> dict:
    """Write the shards and the manifest (see the module docstring); returns the manifest."""
    if max_side < 0 or not 1 <= quality <= 100 or shard_size_mb <= 0 or workers < 1:
        raise PrepareError("need --max-side >= 0, 1 <= --quality <= 100, --shard-size > 0 and --workers >= 1")
    src = src.expanduser().resolve()
    try:
        check_layout(src)
    except DataError as error:
        raise PrepareError(f"source: {error}") from None
    options = {"source": str(src), "shard_size_mb": shard_size_mb, "max_side": max_side,
               "quality": quality if max_side else None}
    check_destination(dst, options)
    if (dst / MANIFEST).is_file():
        print(f"prepare: {dst} is complete (manifest.json present); nothing to do", file=sys.stderr)
        return json.loads((dst / MANIFEST).read_text(encoding="utf-8"))
    (dst / STATE_DIR).mkdir(parents=True, exist_ok=True)
    marker = dst / STATE_DIR / OPTIONS_FILE
    if not marker.exists():
        marker.write_text(json.dumps({"format": FORMAT, "options": options}), encoding="utf-8")
    for stale in dst.glob(".*.tmp-*"):  # partial shards of an interrupted run
        stale.unlink()

    start = time.perf_counter()
    jobs, done, classes = [], {}, None
    splits: dict[str, list[str]] = {}
    for split in SPLITS:
        index = scan_split(src / split)
        classes = classes or index.classes
        records = [Record(f"{i:08d}", str(src / split / path), label)
                   for i, (path, label) in enumerate(zip(index.paths, index.labels))]
        if split == "train":
            # ImageFolder order is class by class; a seeded shuffle before sharding gives every shard
            # many classes, so that the reader's shard permutation and shuffle buffer mix well.
            random.Random(0).shuffle(records)
        shards = plan(records, estimated_sizes(records, max_side, quality), int(shard_size_mb * 2**20))
        splits[split] = []
        for number, shard in enumerate(shards):
            name = shard_name(split, number)
            splits[split].append(name)
            info = finished(dst, name, len(shard))
            if info is not None:
                done[name] = info
            else:
                jobs.append((str(dst), name, shard, max_side, quality))
    total = sum(len(job[2]) for job in jobs)
    if done:
        print(f"prepare: resuming: {len(done)} finished shards verified, {len(jobs)} to write", file=sys.stderr)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="img", desc="prepare", file=sys.stderr, mininterval=1.0)
    if workers > 1 and len(jobs) > 1:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for info in pool.imap_unordered(write_shard, jobs):
                done[info["name"]] = info
                if bar is not None:
                    bar.update(info["images"] + len(info["skipped"]))
    else:
        for job in jobs:
            info = write_shard(job)
            done[info["name"]] = info
            if bar is not None:
                bar.update(info["images"] + len(info["skipped"]))
    if bar is not None:
        bar.close()

    manifest: dict = {"format": FORMAT, "classes": classes, "options": options, "splits": {}, "skipped": []}
    for split, names in splits.items():
        shards = [{key: done[name][key] for key in ("name", "images", "bytes", "sha256")} for name in names]
        manifest["splits"][split] = {"images": sum(s["images"] for s in shards), "shards": shards}
        manifest["skipped"] += [entry for name in names for entry in done[name]["skipped"]]
    manifest["totals"] = {"images": sum(s["images"] for s in manifest["splits"].values()),
                          "bytes": sum(s["bytes"] for split in manifest["splits"].values() for s in split["shards"]),
                          "skipped": len(manifest["skipped"])}
    scratch = dst / f".{MANIFEST}.tmp-{os.getpid()}"
    scratch.write_text(json.dumps(manifest, indent=1), encoding="utf-8")
    os.replace(scratch, dst / MANIFEST)
    for side in (dst / STATE_DIR).iterdir():
        side.unlink()
    (dst / STATE_DIR).rmdir()
    seconds = time.perf_counter() - start
    totals = manifest["totals"]
    print(f"prepare: {totals['images']} images in {sum(len(n) for n in splits.values())} shards, "
          f"{totals['bytes'] / 2**20:.1f} MiB, {totals['skipped']} skipped, {seconds:.1f}s "
          f"({total / max(seconds, 1e-9):.0f} images/s written) -> {dst}", file=sys.stderr)
    for entry in manifest["skipped"][:10]:
        print(f"prepare: skipped unreadable {entry}", file=sys.stderr)
    return manifest


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdtrain prepare", description="Convert an ImageFolder (train/, val/) into WebDataset tar "
        "shards plus manifest.json, for training from shards (data.dir=DST) on shared file systems or "
        "object storage.",
        epilog="Example: python -m hvdtrain prepare /data/imagenet /data/imagenet-shards --max-side 256 --workers 8")
    parser.add_argument("src", help="ImageFolder with train/<class>/<image> and val/<class>/<image>")
    parser.add_argument("dst", help="new or empty folder (or an interrupted prepare's, to resume it)")
    parser.add_argument("--shard-size", type=float, default=256.0, metavar="MB", help="shard size (default 256)")
    parser.add_argument("--max-side", type=int, default=0, metavar="N",
                        help="downscale so that the longer side is at most N and re-encode (default 0: copy)")
    parser.add_argument("--quality", type=int, default=90, metavar="Q", help="JPEG quality with --max-side (default 90)")
    parser.add_argument("--workers", type=int, default=1, metavar="K", help="processes writing shards (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    prepare(Path(args.src), Path(args.dst), args.shard_size, args.max_side, args.quality, args.workers,
            progress=not args.no_progress)
    return 0
