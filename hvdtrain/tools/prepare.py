"""``python -m hvdtrain prepare SRC DST``: an ImageFolder becomes WebDataset tar shards.

Layout of DST (the format ``hvdtrain/data/shards/loader.py`` reads, and the ``webdataset`` library too):

    manifest.json                   classes, images per shard, totals, options, sha256 per shard,
                                    the source files that could not be read or are not images (skipped)
    train-000000.tar ...            {key}.jpg (or .png, ...) + {key}.cls (the label, ASCII digits)
    val-000000.tar ...

Keys are the image's position in its split's ImageFolder listing (``00001234``). Validation
records keep that order; training records are shuffled once with a fixed seed (ImageFolder order
is class by class), so shard contents are a pure function of the source and the options.

Safety and resume: the destination is a folder of the user's that nobody else can write
(hvdtrain/ownership.py; made 0700, as a private run's folders, unless ``--share group`` or
``--share everyone`` asks for 0750 or 0755 within the umask). Each shard is written to a new
``.NAME.tmp-RANDOM`` (O_EXCL: never through a planted link; 0600, 0640 or 0644) and renamed when
complete, then its sidecar ``.prepare/NAME.json`` (image count, sha256). A rerun keeps every shard
whose sidecar is present and whose bytes still hash to it, and writes the others again; the tar
files are deterministic (fixed mtime, owner and member order), so the result is byte-identical to
an uninterrupted run. ``manifest.json`` is written last. Another user's unfinished run is never
adopted (its markers stop the run with one line; a sidecar or shard not the user's own, or that
others can write, is written again), and a destination holding anything that is not this tool's
output for the same source and options is refused.

What goes in: only files that are images (their header parses as one, whether copied or
re-encoded; anything else is skipped and listed in the manifest). Links are followed as
ImageFolder follows them, but a file reached through a link that leaves SRC stops the run with one
line unless ``--follow-links``, checked before anything is written and again on the descriptor each
file is read from (prepare_source.py). A symlink loop stops the scan with one line (``file_index.walk``).

Only Pillow, simplejpeg and the standard library are used: no torch, so workers start fast.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import random
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..data.files.index import DataError, check_layout, scan_split, sha256_file
from ..ownership import (
    GROUP,
    PRIVATE,
    UMASK,
    UnsafePath,
    current_umask,
    file_mode,
    open_trusted,
    own_folder,
    write_atomic,
)
from .prepare_source import LeftSource, encode, outside_links

FORMAT = "hvdtrain-shards-v1"
MANIFEST = "manifest.json"
STATE_DIR = ".prepare"           # sidecars and the options of an unfinished run
OPTIONS_FILE = "options.json"
SPLITS = ("train", "val")
# Images re-encoded to estimate the output size per image when --max-side plans the shards.
ESTIMATE_SAMPLE = 32

# --share: who may read the shards (ownership.py's modes).
SHARE_CHOICES = {"private": PRIVATE, "group": GROUP, "everyone": UMASK}


class PrepareError(DataError):
    """A problem with prepare's arguments, source or destination, as one line."""


@dataclass
class Record:
    key: str
    path: str   # absolute source path
    label: int


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:06d}.tar"


def tar_member(name: str, data: bytes) -> tuple[tarfile.TarInfo, io.BytesIO]:
    """A member whose header does not depend on the machine, the user or the time."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info, io.BytesIO(data)


def fresh_file(folder: Path, name: str, share: str = PRIVATE) -> tuple[BinaryIO, Path]:
    """A new file ``.NAME.tmp-RANDOM`` in ``folder`` (O_EXCL: a link planted at a name we would pick
    is never written through), ``ownership.file_mode(share)`` within the umask (0600 by default)."""
    descriptor, path = tempfile.mkstemp(prefix=f".{name}.tmp-", dir=folder)
    os.fchmod(descriptor, file_mode(share) & ~current_umask())
    return os.fdopen(descriptor, "wb"), Path(path)


def read_trusted(path: Path) -> bytes:
    """A previous run's file, if this user (or root) owns it and nobody else can write it (else UnsafePath)."""
    with os.fdopen(open_trusted(path), "rb") as handle:
        return handle.read()


def write_shard(job: tuple[str, str, list[Record], int, int, str | None, str]) -> dict:
    """Write one shard (temporary name, then rename) and its sidecar; returns the sidecar. ``inside``
    (the source folder and a separator, or None with --follow-links): where each file read must lie
    (prepare_source.open_source); a file that leads elsewhere stops the run (LeftSource)."""
    dst, name, records, max_side, quality, inside, share = job
    final, state = Path(dst) / name, Path(dst) / STATE_DIR / f"{name}.json"
    handle, scratch = fresh_file(Path(dst), name, share)
    skipped: list[str] = []
    images = 0
    try:
        with handle, tarfile.open(fileobj=handle, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for record in records:
                try:
                    data, ext = encode(record.path, max_side, quality, inside)
                except LeftSource:
                    raise
                except (OSError, ValueError) as error:
                    skipped.append(f"{record.path} ({getattr(error, 'strerror', None) or error})")
                    continue
                label = str(record.label).encode()
                for member, payload in ((f"{record.key}.{ext}", data), (f"{record.key}.cls", label)):
                    tar.addfile(*tar_member(member, payload))
                images += 1
    except LeftSource:
        scratch.unlink()  # nothing of a source that changed under the run is kept
        raise
    info = {"name": name, "images": images, "bytes": scratch.stat().st_size, "sha256": sha256_file(scratch),
            "skipped": skipped}
    os.replace(scratch, final)
    write_atomic(state, json.dumps(info), share)
    return info


def finished(dst: Path, name: str, expected_records: int) -> dict | None:
    """The sidecar of a shard a previous run completed, when the shard still matches it. The sidecar
    and the shard must be this user's (or root's) and writable by nobody else: another user's file
    is never adopted, it is written again (the rename replaces it)."""
    try:
        info = json.loads(read_trusted(dst / STATE_DIR / f"{name}.json").decode("utf-8"))
        ok = (info["images"] + len(info["skipped"]) == expected_records
              and sha256_file(open_trusted(dst / name)) == info["sha256"])
    except (OSError, ValueError, KeyError, TypeError):  # UnsafePath is a ValueError
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


def estimated_sizes(records: list[Record], max_side: int, quality: int, inside: str | None) -> list[int]:
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
            sample.append(len(encode(record.path, max_side, quality, inside)[0]) + 1536)
        except LeftSource:
            raise
        except (OSError, ValueError):
            pass
    mean = sum(sample) / len(sample) if sample else 1024
    return [int(mean)] * len(records)


def check_destination(dst: Path, options: dict, share: str = PRIVATE) -> None:
    """Make the destination, or refuse it: not a folder of this user's that nobody else can write
    (hvdtrain/ownership.py), or not empty and not an unfinished or finished run with these options,
    or holding such a run's markers that another user wrote or can change."""
    if dst.exists() and not dst.is_dir():
        raise PrepareError(f"destination {dst} is a file (give a new or empty folder)")
    try:
        own_folder(dst, share, what="destination", fix="give a new folder of yours")
        if os.path.lexists(dst / STATE_DIR):
            own_folder(dst / STATE_DIR, share, what="destination's state folder",
                       fix="delete the destination or give a new folder of yours")
    except UnsafePath as error:
        raise PrepareError(str(error)) from None
    entries = os.listdir(dst)
    if not entries:
        return
    for marker in (dst / MANIFEST, dst / STATE_DIR / OPTIONS_FILE):
        try:
            previous = json.loads(read_trusted(marker).decode("utf-8"))
        except UnsafePath as error:
            raise PrepareError(f"destination {dst} holds a prepare run that is not yours to continue: {error}; "
                               f"delete it, or give a new folder") from None
        except (OSError, ValueError):
            continue
        if not isinstance(previous, dict):
            continue
        if previous.get("format") == FORMAT and previous.get("options") == options:
            return
        raise PrepareError(f"destination {dst} holds shards prepared with other options "
                           f"({previous.get('options')}); give a new folder or delete it")
    raise PrepareError(f"destination {dst} is not empty and holds no hvdtrain prepare output "
                       f"({len(entries)} entries, e.g. {sorted(entries)[0]}): give a new or empty folder")


def prepare(src: Path, dst: Path, shard_size_mb: float = 256.0, max_side: int = 0, quality: int = 90,
            workers: int = 1, progress: bool = True, follow_links: bool = False, share: str = PRIVATE) -> dict:
    """Write the shards and the manifest (see the module docstring); returns the manifest.

    Links inside the source are followed as ImageFolder follows them; a file reached through a
    link that leaves the source folder is refused (one line naming it) unless ``follow_links``:
    in a folder others can write to, such a link would copy any file this user can read (a
    private key) into the shards; each file is checked again on the descriptor it is read from
    (prepare_source.py). A symlink loop stops the scan (file_index.walk). The shards and the manifest
    are written with ``share``'s modes (ownership.py): private (0700/0600) unless asked for more."""
    if max_side < 0 or not 1 <= quality <= 100 or shard_size_mb <= 0 or workers < 1:
        raise PrepareError("need --max-side >= 0, 1 <= --quality <= 100, --shard-size > 0 and --workers >= 1")
    src = src.expanduser().resolve()
    try:
        check_layout(src)
    except DataError as error:
        raise PrepareError(f"source: {error}") from None
    options = {"source": str(src), "shard_size_mb": shard_size_mb, "max_side": max_side,
               "quality": quality if max_side else None}
    check_destination(dst, options, share)
    if (dst / MANIFEST).is_file():
        print(f"prepare: {dst} is complete (manifest.json present); nothing to do", file=sys.stderr)
        return json.loads(read_trusted(dst / MANIFEST).decode("utf-8"))  # check_destination trusted it
    own_folder(dst / STATE_DIR, share, what="destination's state folder")
    marker = dst / STATE_DIR / OPTIONS_FILE
    if not marker.exists():
        write_atomic(marker, json.dumps({"format": FORMAT, "options": options}), share)
    inside = None if follow_links else str(src) + os.sep
    for stale in [*dst.glob(".*.tmp-*"), *dst.glob(".*.tmp"), *(dst / STATE_DIR).glob(".*.tmp")]:
        stale.unlink()  # partial files of an interrupted run

    start = time.perf_counter()
    jobs, done, classes = [], {}, None
    splits: dict[str, list[str]] = {}
    for split in SPLITS:
        try:
            index = scan_split(src / split)
        except DataError as error:
            raise PrepareError(f"source: {error}") from None
        outside = [] if follow_links else outside_links(src, split, index.paths)
        if outside:
            path, target = outside[0]
            raise PrepareError(f"{len(outside)} file(s) in {src / split} lead outside {src} through links (e.g. "
                               f"{path} -> {target}): remove the links, or pass --follow-links if they are "
                               f"images you mean to include")
        classes = classes or index.classes
        records = [Record(f"{i:08d}", str(src / split / path), label)
                   for i, (path, label) in enumerate(zip(index.paths, index.labels))]
        if split == "train":
            # ImageFolder order is class by class; a seeded shuffle before sharding gives every shard
            # many classes, so that the reader's shard permutation and shuffle buffer mix well.
            random.Random(0).shuffle(records)
        shards = plan(records, estimated_sizes(records, max_side, quality, inside), int(shard_size_mb * 2**20))
        splits[split] = []
        for number, shard in enumerate(shards):
            name = shard_name(split, number)
            splits[split].append(name)
            info = finished(dst, name, len(shard))
            if info is not None:
                done[name] = info
            else:
                jobs.append((str(dst), name, shard, max_side, quality, inside, share))
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
    write_atomic(dst / MANIFEST, json.dumps(manifest, indent=1), share)
    for side in (dst / STATE_DIR).iterdir():
        side.unlink()
    (dst / STATE_DIR).rmdir()
    seconds = time.perf_counter() - start
    totals = manifest["totals"]
    print(f"prepare: {totals['images']} images in {sum(len(n) for n in splits.values())} shards, "
          f"{totals['bytes'] / 2**20:.1f} MiB, {totals['skipped']} skipped, {seconds:.1f}s "
          f"({total / max(seconds, 1e-9):.0f} images/s written) -> {dst}", file=sys.stderr)
    for entry in manifest["skipped"][:10]:
        print(f"prepare: skipped {entry}", file=sys.stderr)
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
    parser.add_argument("--quality", type=int, default=90, metavar="Q",
                        help="JPEG quality with --max-side (default 90)")
    parser.add_argument("--workers", type=int, default=1, metavar="K", help="processes writing shards (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--follow-links", action="store_true",
                        help="include files reached through links that leave SRC (default: refuse them)")
    parser.add_argument("--share", choices=sorted(SHARE_CHOICES), default="private",
                        help="who may read the shards: private (0700 folder, 0600 files; the default), group "
                        "(0750, 0640) or everyone (0755, 0644), each within the umask")
    args = parser.parse_args(argv)
    prepare(Path(args.src), Path(args.dst), args.shard_size, args.max_side, args.quality, args.workers,
            progress=not args.no_progress, follow_links=args.follow_links, share=SHARE_CHOICES[args.share])
    return 0
