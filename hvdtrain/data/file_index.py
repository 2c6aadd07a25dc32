"""The list of image files of an ImageFolder dataset: checked, scanned once, cached, shared.

Listing 1.28M files takes minutes on a network file system, and every rank doing it at every
start multiplies that. Rank 0 checks the layout, then loads the index from a cache file, or scans
and writes one; every other rank receives rank 0's index by broadcast and never touches the
folder tree. The order of files and classes is exactly ``torchvision.datasets.ImageFolder``'s.

The cache key is, per split, the names and modification times of the split folder and of every
class folder. Adding, removing or renaming a file directly in a class folder changes that
folder's mtime, so the index is rebuilt. Not noticed: changes only inside nested subfolders of
a class folder, and a file's contents rewritten in place (the index holds names, not contents);
delete the cache file or set ``data.index_cache=false`` after such changes.

The cache file is JSON (like checkpoints, it never unpickles anything): a file that does not
parse, or that holds another format (e.g. the pickles of hvdtrain-file-index-v1), is a cache miss
and is rewritten, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")
FORMAT = "hvdtrain-file-index-v2"


class DataError(ValueError):
    """A problem with the dataset folder, phrased as one line for the user."""


class LayoutError(DataError):
    """The dataset folder is not laid out as train/<class>/<image> and val/<class>/<image>."""


@dataclass
class SplitIndex:
    """One split: class names, and each image's path (relative to the split folder) and label."""

    classes: list[str]
    paths: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.paths)


@dataclass
class FileIndex:
    root: str
    train: SplitIndex
    val: SplitIndex
    source: str = "scan"  # "scan" or "cache", for the startup log
    seconds: float = 0.0
    note: str = ""        # e.g. where the validation split of data.val_fraction came from


def class_folders(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def check_layout(root: Path, splits: tuple[str, ...] = SPLITS) -> None:
    """One line for each mistake people make, before anything is scanned."""
    if not root.is_dir():
        raise LayoutError(f"data.dir '{root}' does not exist (set data.dir to a folder with train/ and val/)")
    for split in splits:
        if not (root / split).is_dir():
            hint = " or set data.val_fraction=0.1 to validate on a part of train/" if split == "val" else ""
            raise LayoutError(f"data.dir '{root}' has no {split}/ folder (expected {root}/{split}/<class>/<image>"
                              f"{hint})")
    train_classes = class_folders(root / "train")
    if not train_classes:
        raise LayoutError(f"{root}/train has no class folders (expected {root}/train/<class>/<image>)")
    val_classes = class_folders(root / "val") if "val" in splits else train_classes
    if train_classes != val_classes:
        only_train = sorted(set(train_classes) - set(val_classes))[:5]
        only_val = sorted(set(val_classes) - set(train_classes))[:5]
        raise LayoutError(f"classes in {root}/val differ from {root}/train "
                          f"(only in train: {only_train}, only in val: {only_val}); use the same class folders")


def is_image_name(name: str) -> bool:
    return name.lower().endswith(IMG_EXTENSIONS)


def walk(top: Path) -> list[tuple[str, list[str]]]:
    """``sorted(os.walk(top, followlinks=True))``'s folders and file names (links followed, as
    ImageFolder follows them; unreadable folders skipped), except that a link leading back to a
    folder it is in stops with one line: os.walk would go round the loop until paths grow too
    long (one loop indexed 2,112 files for 192; two grew the index to 3 GB in a minute)."""
    found: list[tuple[str, list[str]]] = []
    # Each folder with the (device, inode) and path of every folder above it, itself included.
    stack: list[tuple[str, tuple[tuple[tuple[int, int], str], ...]]] = [(str(top), ())]
    while stack:
        folder, above = stack.pop()
        try:
            stat = os.stat(folder)
            entries = list(os.scandir(folder))
        except OSError:
            continue
        identity = (stat.st_dev, stat.st_ino)
        for seen, where in above:
            if seen == identity:
                raise LayoutError(f"symlink loop: {folder} leads back to {where}, a folder it is in; "
                                  f"remove that link")
        above = above + ((identity, folder),)
        files: list[str] = []
        for entry in entries:
            try:
                is_dir = entry.is_dir()
            except OSError:
                is_dir = False
            if is_dir:
                stack.append((os.path.join(folder, entry.name), above))
            else:
                files.append(entry.name)
        found.append((folder, files))
    return sorted(found)


def scan_split(split_dir: Path) -> SplitIndex:
    """ImageFolder's listing: classes sorted, files of each class in sorted os.walk order."""
    classes = class_folders(split_dir)
    paths: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        before = len(paths)
        for folder, names in walk(split_dir / name):
            relative = os.path.relpath(folder, split_dir)
            paths.extend(os.path.join(relative, f) for f in sorted(names) if is_image_name(f))
        labels.extend([label] * (len(paths) - before))
        if len(paths) == before:
            raise LayoutError(f"class folder {split_dir / name} has no image files "
                              f"({', '.join(IMG_EXTENSIONS)}); add images or remove the folder")
    return SplitIndex(classes, paths, labels)


def cache_key(root: Path, splits: tuple[str, ...] = SPLITS) -> str:
    """Changes when a class folder is added, removed or renamed, or a file in one is."""
    digest = hashlib.sha256(FORMAT.encode())
    for split in splits:
        split_dir = root / split
        digest.update(f"{split}:{split_dir.stat().st_mtime_ns}\n".encode())
        for name in class_folders(split_dir):
            digest.update(f"{name}:{(split_dir / name).stat().st_mtime_ns}\n".encode())
    return digest.hexdigest()


def cache_file(root: Path, cache_dir: Path) -> Path:
    name = hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:20]
    return cache_dir / "file-index" / f"{name}.json"


def split_from_json(data: Any) -> SplitIndex | None:
    """A SplitIndex from its JSON form, or None where anything is missing or mistyped."""
    if not isinstance(data, dict):
        return None
    classes, paths, labels = data.get("classes"), data.get("paths"), data.get("labels")
    if not (isinstance(classes, list) and isinstance(paths, list) and isinstance(labels, list)
            and len(paths) == len(labels) and all(isinstance(c, str) for c in classes)
            and all(isinstance(p, str) for p in paths)
            and all(type(label) is int and 0 <= label < len(classes) for label in labels)):
        return None
    return SplitIndex(classes, paths, labels)


def load_cached(path: Path, key: str) -> FileIndex | None:
    """The cached index when ``path`` holds this format and ``key``; None (a miss) otherwise."""
    try:
        payload = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("key") != key:
        return None
    root, train, val = payload.get("root"), split_from_json(payload.get("train")), split_from_json(payload.get("val"))
    if not isinstance(root, str) or train is None or val is None:
        return None
    return FileIndex(root, train, val)


def write_cache(path: Path, key: str, index: FileIndex) -> None:
    """Atomically (a reader sees the old file or the new one); a read-only cache is not an error."""
    payload = {"format": FORMAT, "key": key, "root": index.root,
               "train": {"classes": index.train.classes, "paths": index.train.paths, "labels": index.train.labels},
               "val": {"classes": index.val.classes, "paths": index.val.paths, "labels": index.val.labels}}
    scratch = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A fresh name (O_EXCL, mode 0600): a file or link planted at a predictable name is never written through.
        descriptor, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            json.dump(payload, handle, separators=(",", ":"))
        os.replace(scratch, path)
    except OSError:
        if scratch is not None:
            try:
                os.unlink(scratch)
            except OSError:
                pass


def build_index(root: Path, cache_dir: Path | None, splits: tuple[str, ...] = SPLITS) -> FileIndex:
    """Check the layout, then read the cache (when given and current) or scan and write it.
    ``splits=("train",)``: no val/ folder (its index is empty; data.val_fraction splits train/)."""
    start = time.perf_counter()
    check_layout(root, splits)
    key = path = None
    if cache_dir is not None:
        key, path = cache_key(root, splits), cache_file(root, cache_dir)
        cached = load_cached(path, key)
        if cached is not None:
            cached.root, cached.source, cached.seconds = str(root), "cache", time.perf_counter() - start
            return cached
    train = scan_split(root / "train")
    val = scan_split(root / "val") if "val" in splits else SplitIndex(list(train.classes), [], [])
    index = FileIndex(str(root), train, val)
    if path is not None and key is not None:
        write_cache(path, key, index)
    index.seconds = time.perf_counter() - start
    return index


def shared_index(root: Path, cache_dir: Path | None, is_primary: bool,
                 broadcast_object: Callable[[Any], Any] | None = None,
                 splits: tuple[str, ...] = SPLITS) -> FileIndex:
    """Rank 0 builds the index (or finds the problem); every rank gets the same result.

    A layout problem is broadcast too, so that every rank raises the same one-line error instead
    of the other ranks waiting forever for rank 0. Without ``broadcast_object`` (elastic workers,
    which must not call collectives while joining) every process builds or loads it itself.
    """
    result: tuple[str, Any] = ("error", "not built")
    if is_primary or broadcast_object is None:
        try:
            result = ("ok", build_index(root, cache_dir, splits))
        except LayoutError as error:
            result = ("error", str(error))
    if broadcast_object is not None:
        result = broadcast_object(result)
    status, value = result
    if status != "ok":
        raise LayoutError(value)
    return value


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes (hex), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
