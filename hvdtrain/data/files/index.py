"""The list of image files of an ImageFolder dataset: checked, scanned once, cached, shared.

Listing 1.28M files takes minutes on a network file system, and every rank doing it at every
start multiplies that. Rank 0 checks the layout, then loads the index from a cache file, or scans
and writes one; every other rank maps the same cache file where its host sees it (checked against
rank 0's by the file's digest), or receives rank 0's bytes, and never touches the folder tree. The
order of files and classes is exactly ``torchvision.datasets.ImageFolder``'s.

The cache key is, per split, the names and modification times of the split folder and of every
class folder. Adding, removing or renaming a file directly in a class folder changes that
folder's mtime, so the index is rebuilt. Not noticed: changes only inside nested subfolders of
a class folder, and a file's contents rewritten in place (the index holds names, not contents);
delete the cache file or set ``data.index_cache=false`` after such changes.

The cache file holds the compact arrays of ``file_list.py`` behind a JSON header (format v3):
loading it is a memory map and a check of every bound, offset and label, about 0.1 s at 14.2M
files, and the loader workers of every rank of the host read that one copy. Like checkpoints, it
never unpickles anything: a file that does not parse, fails a check, or holds another format (the
JSON of hvdtrain-file-index-v2, the pickles of v1) is a cache miss and is rewritten, never an error;
so is one another user owns or can write, or whose paths leave data.dir (absolute, through ``..``).
The cache folder must be the user's (hvdtrain/ownership.py; made 0700), else it is not used.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from ...environment import describe as describe_path
from ...environment import unreadable_line, user_name
from ...ownership import UnsafePath, own_folder
from .file_list import Buffer, IntArray, PathArray, decode_index, encode_index, read_header

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
SPLITS = ("train", "val")
FORMAT = "hvdtrain-file-index-v3"


class DataError(ValueError):
    """A problem with the dataset folder, phrased as one line for the user."""


class DamagedData(DataError):
    """A value read from a data set's own files (a shard manifest, a tar header) that cannot be right:
    a count that is not a number or exceeds what the files hold, a name that leaves the folder. One
    line, and exit code 65 (EX_DATAERR: the data is wrong, not the command), never a traceback or an
    allocation of the size a file claims."""

    exit_code = 65


class LayoutError(DataError):
    """The dataset folder is not laid out as train/<class>/<image> and val/<class>/<image>."""


@dataclass(eq=False)
class SplitIndex:
    """One split: class names, and each image's path (relative to the split folder) and label:
    compact arrays (``PathArray``, ``IntArray``) in a shared buffer, or lists (a scan's result)."""

    classes: list[str]
    paths: Sequence[str]
    labels: Sequence[int]

    def __len__(self) -> int:
        return len(self.paths)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SplitIndex):
            return NotImplemented
        return (list(self.classes) == list(other.classes) and len(self) == len(other)
                and _same(self.paths, other.paths) and _same(self.labels, other.labels))


def _same(first: Sequence, second: Sequence) -> bool:
    if isinstance(first, (PathArray, IntArray)):
        return first == second
    if isinstance(second, (PathArray, IntArray)):
        return second == first
    return list(first) == list(second)


@dataclass
class FileIndex:
    root: str
    train: SplitIndex
    val: SplitIndex
    source: str = "scan"  # "scan" or "cache", for the startup log
    seconds: float = 0.0
    note: str = ""        # e.g. where the validation split of data.val_fraction came from
    buffer: Buffer | None = None  # where the compact lists live; None: lists (built by hand)
    header: dict = field(default_factory=dict)  # key, digest and size of the buffer's index
    received_by: int = 0  # ranks that got rank 0's bytes (no cache file of theirs to map)

    @property
    def nbytes(self) -> int:
        """The bytes of the shared file list (both splits, as in the cache file)."""
        return self.buffer.size if self.buffer is not None else 0

    def sharing(self) -> str:
        """How the list is shared, for the start-up line."""
        if self.buffer is None:
            return "Python lists, copied into each worker"
        return self.buffer.description + (f"; {self.received_by} rank(s) received it by broadcast and hold a copy "
                                          f"each" if self.received_by else "")


def class_folders(split_dir: Path) -> list[str]:
    return sorted(entry.name for entry in os.scandir(split_dir) if entry.is_dir())


def unreadable_problem(root: Path, splits: tuple[str, ...] = SPLITS) -> str | None:
    """The line for the first folder of the data set this user may not list (another user's data, a
    group not joined): the root, a split, a class folder (a scan would skip it silently); else None.
    ``hvdtrain doctor`` says the same (tools/doctor_checks.py)."""
    folders = [root] + [root / split for split in splits]
    for folder in folders:
        if folder.is_dir() or folder == root:
            line = unreadable_line(folder)
            if line:
                return line
    for split in splits:
        if (root / split).is_dir():
            for name in class_folders(root / split):
                line = unreadable_line(root / split / name)
                if line:
                    return line
    return None


def check_layout(root: Path, splits: tuple[str, ...] = SPLITS) -> None:
    """One line for each mistake people make, before anything is scanned."""
    if not root.is_dir():
        if root.parent.is_dir() and not os.access(root.parent, os.X_OK):  # hidden, not missing: say so
            raise DataError(f"data.dir: this user ({user_name(os.geteuid())}) cannot enter '{root.parent}' "
                            f"({describe_path(str(root.parent))}), so '{root}' cannot be read: ask its owner for "
                            f"access")
        raise LayoutError(f"data.dir '{root}' does not exist (set data.dir to a folder with train/ and val/)")
    problem = unreadable_problem(root, splits)
    if problem:
        raise DataError(problem)
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
    return cache_dir / "file-index" / f"{name}.index"


def index_of(buffer: Buffer) -> FileIndex | None:
    """The index a buffer holds (every bound and value checked), or None."""
    decoded = decode_index(buffer)
    if decoded is None:
        return None
    header, splits = decoded
    if header.get("format") != FORMAT or not isinstance(header.get("root"), str) \
            or not isinstance(header.get("key"), str) or not isinstance(header.get("digest"), str):
        return None
    train, val = (SplitIndex(*splits[name]) for name in SPLITS)
    return FileIndex(header["root"], train, val, buffer=buffer,
                     header={"key": header["key"], "digest": header["digest"], "size": buffer.size})


def load_cached(path: Path, key: str) -> FileIndex | None:
    """The cached index when ``path`` holds this format and ``key``; None (a miss) otherwise."""
    try:
        buffer = Buffer.of_file(path)
        found = read_header(buffer)
    except (OSError, ValueError):
        return None
    if found is None or found[0].get("format") != FORMAT or found[0].get("key") != key:
        return None
    return index_of(buffer)


def encode(key: str, index: FileIndex) -> list:
    return encode_index({"format": FORMAT, "key": key, "root": index.root},
                        {name: (split.classes, split.paths, split.labels)
                         for name, split in (("train", index.train), ("val", index.val))})


def store(path: Path, chunks: Iterable) -> Buffer | None:
    """Write ``chunks`` to ``path`` atomically (a reader sees the old file or the new one) and map
    what was written; None where the cache cannot be written (not an error). The file is replaced,
    never rewritten in place, so every mapping of an older one stays intact."""
    scratch = None
    try:
        # The folder is checked (usable_cache); a fresh name (O_EXCL, mode 0600): a file or link
        # planted at a predictable name is never written through.
        descriptor, scratch = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(descriptor, "wb") as handle:
            handle.writelines(chunks)
            written = os.fstat(handle.fileno())
        buffer = Buffer.of_file(scratch)  # read-only, before the rename: the inode just written
        same = os.fstat(buffer.fd)
        if (same.st_dev, same.st_ino) != (written.st_dev, written.st_ino):
            raise OSError(f"{scratch} was replaced while it was written")
        os.replace(scratch, path)
        scratch = None
        try:  # the JSON cache of hvdtrain-file-index-v2 (hundreds of MB on large datasets)
            path.with_suffix(".json").unlink()
        except OSError:
            pass
        return buffer
    except (OSError, ValueError):  # ValueError: ownership.UnsafePath
        if scratch is not None:
            try:
                os.unlink(scratch)
            except OSError:
                pass
        return None


def write_cache(path: Path, key: str, index: FileIndex) -> FileIndex | None:
    """``index`` written to the cache file ``path`` under ``key``, and mapped from there; None
    where the cache cannot be written."""
    buffer = store(path, encode(key, index))
    return None if buffer is None else index_of(buffer)


def compact(index: FileIndex, key: str = "") -> FileIndex:
    """``index`` (lists) as compact arrays in anonymous shared memory, where no cache file holds
    it: one copy per rank, which its loader workers map instead of unpickling their own."""
    result = index_of(Buffer.in_memory(encode(key, index)))
    assert result is not None
    result.root, result.source, result.seconds, result.note = index.root, index.source, index.seconds, index.note
    return result


def usable_cache(cache_dir: Path | None) -> Path | None:
    """``cache_dir`` when its ``file-index`` folder is made or found by the ownership rule; else None
    and one warning line: no cache is then read from or written to another user's folder."""
    if cache_dir is None:
        return None
    try:
        own_folder(cache_dir / "file-index", what="file index cache folder",
                   fix="set HVDTRAIN_CACHE to a folder of yours (or data.index_cache=false)")
    except UnsafePath as error:
        print(f"hvdtrain: warning: {error}; the file index is not cached", file=sys.stderr, flush=True)
        return None
    return cache_dir


def build_index(root: Path, cache_dir: Path | None, splits: tuple[str, ...] = SPLITS) -> FileIndex:
    """Check the layout, then read the cache (when given and current) or scan and write it.
    ``splits=("train",)``: no val/ folder (its index is empty; data.val_fraction splits train/).
    The result's lists are compact arrays, mapped from the cache file or held in shared memory."""
    start = time.perf_counter()
    check_layout(root, splits)
    key = path = None
    cache_dir = usable_cache(cache_dir)
    if cache_dir is not None:
        key, path = cache_key(root, splits), cache_file(root, cache_dir)
        cached = load_cached(path, key)
        if cached is not None:
            cached.root, cached.source, cached.seconds = str(root), "cache", time.perf_counter() - start
            return cached
    train = scan_split(root / "train")
    val = scan_split(root / "val") if "val" in splits else SplitIndex(list(train.classes), [], [])
    scanned = FileIndex(str(root), train, val)
    index = write_cache(path, key, scanned) if path is not None and key is not None else None
    if index is None:
        index = compact(scanned, key or "")
    index.root, index.seconds = str(root), time.perf_counter() - start
    return index


def sha256_file(path: Path | int) -> str:
    """The SHA-256 (hex) of a file's bytes, or of an open descriptor's (then closed), in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
