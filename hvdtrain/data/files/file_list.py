"""Compact file lists that loader workers and ranks share instead of copying.

A Python list of 1.28M path strings and one of labels take about 150 MiB, and every forkserver
loader worker unpickled its own copy. Here a split is three flat arrays: the paths' UTF-8 bytes
(a NUL after each), where each path starts, and the labels, about 40 bytes a file for ImageNet's
names. They sit in one read-only ``Buffer`` laid out as the index cache file (``encode_index``,
``decode_index``): a memory map of that file, or, where there is no cache, of an anonymous memory
file (``memfd``, freed with its last user: nothing is left in /dev/shm after a crash). A buffer
pickled into a starting worker travels as a file descriptor (the way torch shares tensors), so the
worker maps the same pages: one copy for a rank and all its workers, and for every rank of a host
that maps the same cache file. Nothing read from a buffer is ever unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import multiprocessing.context
import multiprocessing.reduction
import os
import stat
import tempfile
from collections.abc import Sequence
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ...ownership import open_trusted

MAGIC = b"hvdtrain-file-index-v3\n"
ALIGN = 64
MAX_HEADER = 64 << 20                       # the class names of ImageNet-21k take about 0.3 MB
OFFSET_TYPES = ("<u4", "<i8")               # where each path starts: 4 bytes while the paths fit in 4 GiB
LABEL_TYPES = ("<i2", "<i4")                # 2 bytes up to 32,767 classes (ImageNet-21k has 21,841)
CHUNK = 1 << 16                             # paths decoded per step when a whole list is iterated
SEND_CHUNK = 64 << 20                       # bytes per collective when rank 0 sends its list


class Buffer:
    """A read-only memory map of a file descriptor: the index cache file, or anonymous memory."""

    def __init__(self, fd: int, description: str):
        size = os.fstat(fd).st_size
        self.map = mmap.mmap(fd, size, access=mmap.ACCESS_READ) if size else b""
        # Owned (closed by __del__) only once mapped: a failure leaves the descriptor to the caller.
        self.fd, self.size, self.description = fd, size, description

    @classmethod
    def of_file(cls, path: str | os.PathLike) -> "Buffer":
        """Map a cache file: a regular file this user (or root) owns and nobody else can write, never
        through another user's link (ownership.open_trusted: UnsafePath, a ValueError); OSError for a
        missing or unreadable one."""
        fd = open_trusted(path)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(f"{path} is not a regular file")
            return cls(fd, "the index cache file, mapped")
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def in_memory(cls, chunks: Iterable) -> "Buffer":
        """The bytes of ``chunks`` in anonymous shared memory. Costs their size once per rank (its
        workers map the same pages); used where there is no cache file to map."""
        if hasattr(os, "memfd_create"):
            fd = os.memfd_create("hvdtrain-file-list", os.MFD_CLOEXEC)
        else:  # not Linux: an unlinked temporary file
            fd = os.dup(tempfile.TemporaryFile().fileno())
        try:
            for chunk in chunks:
                view = memoryview(chunk).cast("B")
                while view:
                    view = view[os.write(fd, view):]
            return cls(fd, "anonymous memory, one copy per rank")
        except BaseException:
            os.close(fd)
            raise

    def array(self, offset: int, dtype: str, count: int) -> np.ndarray:
        return np.frombuffer(self.map, dtype=np.dtype(dtype), count=count, offset=offset) if count else \
            np.empty(0, dtype=np.dtype(dtype))

    def __reduce__(self):
        # Into a starting loader worker (forkserver or spawn): the descriptor, not the bytes.
        if multiprocessing.context.get_spawning_popen() is not None:
            return _from_fd, (multiprocessing.reduction.DupFd(self.fd), self.description)
        return Buffer.in_memory, ([bytes(self.map)],)

    def __del__(self) -> None:
        try:
            os.close(self.fd)
        except (OSError, AttributeError, TypeError):
            pass


def _from_fd(duplicate: Any, description: str) -> Buffer:
    return Buffer(duplicate.detach(), description)


class IntArray(Sequence):
    """A read-only integer array in a ``Buffer``: ``len``, ``[i]`` (an int), iteration, ``np.asarray``."""

    def __init__(self, buffer: Buffer, offset: int, dtype: str, count: int):
        self.buffer, self.layout = buffer, (offset, dtype, count)
        self.values = buffer.array(offset, dtype, count)

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.values[index].tolist()
        return int(self.values[index])

    def __iter__(self) -> Iterator[int]:
        for start in range(0, len(self.values), CHUNK):
            yield from self.values[start:start + CHUNK].tolist()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return self.values if dtype is None else self.values.astype(dtype)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (IntArray, list, tuple, np.ndarray)):
            return len(other) == len(self) and bool(np.array_equal(self.values, np.asarray(other)))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        return self.values.nbytes

    def __reduce__(self):
        return IntArray, (self.buffer, *self.layout)


class PathArray(Sequence):
    """Read-only strings in a ``Buffer`` (UTF-8 bytes, a NUL after each, and where each starts):
    ``len``, ``[i]`` (a str), iteration, ``in`` and ``index`` (by scanning), equality with a list."""

    def __init__(self, buffer: Buffer, names_offset: int, names_size: int, starts_offset: int, starts_type: str,
                 count: int):
        self.buffer, self.layout = buffer, (names_offset, names_size, starts_offset, starts_type, count)
        self.names = memoryview(buffer.map)[names_offset:names_offset + names_size] if names_size else memoryview(b"")
        self.starts = buffer.array(starts_offset, starts_type, count + 1)

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("path index out of range")
        return str(self.names[int(self.starts[index]):int(self.starts[index + 1]) - 1], "utf-8", "surrogatepass")

    def __iter__(self) -> Iterator[str]:
        names = self.names
        for first in range(0, len(self), CHUNK):
            starts = self.starts[first:first + CHUNK + 1].tolist()
            for begin, end in zip(starts, starts[1:]):
                yield str(names[begin:end - 1], "utf-8", "surrogatepass")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PathArray):
            return np.array_equal(self.starts, other.starts) and self.names == other.names
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    @property
    def nbytes(self) -> int:
        return len(self.names) + self.starts.nbytes

    def __reduce__(self):
        return PathArray, (self.buffer, *self.layout)


# --- the layout: a header line, a JSON header, then the arrays of each split ---------------------

def _pad(size: int) -> int:
    return -size % ALIGN


def encode_split(paths: Sequence[str], labels: Sequence[int], classes: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    """(names, starts, labels) of one split: the arrays ``PathArray``/``IntArray`` read."""
    if isinstance(paths, PathArray):
        names, starts = bytes(paths.names), np.asarray(paths.starts)
    else:
        names = ("\0".join(paths) + "\0").encode("utf-8", "surrogatepass") if len(paths) else b""
        ends = np.flatnonzero(np.frombuffer(names, dtype=np.uint8) == 0)
        if len(ends) != len(paths):  # a NUL inside a name (never from a folder scan): measured one by one
            ends = np.cumsum([len(p.encode("utf-8", "surrogatepass")) + 1 for p in paths], dtype=np.int64) - 1
        starts = np.concatenate([[0], ends + 1])
    starts = starts.astype(OFFSET_TYPES[0] if len(names) < 2**32 else OFFSET_TYPES[1], copy=False)
    labels = np.asarray(labels, dtype=LABEL_TYPES[0] if classes < 2**15 else LABEL_TYPES[1])
    return names, starts, labels


def encode_index(fields: dict[str, Any], splits: dict[str, tuple[list[str], Sequence[str], Sequence[int]]]) -> list:
    """The bytes of an index (a list of chunks to write or send): ``fields`` (format, key, root...)
    and, per split, (classes, paths, labels)."""
    sections: list = []
    layout: dict[str, Any] = {}
    position = 0  # relative to the end of the header block

    def place(data) -> int:
        nonlocal position
        start = position
        sections.append(data)
        position += len(memoryview(data).cast("B"))
        sections.append(b"\0" * _pad(position))
        position += _pad(position)
        return start

    for name, (classes, paths, labels) in splits.items():
        names, starts, label_array = encode_split(paths, labels, len(classes))
        layout[name] = {"classes": list(classes), "count": len(starts) - 1, "names": [place(names), len(names)],
                        "starts": [place(starts), starts.dtype.str],
                        "labels": [place(label_array), label_array.dtype.str]}
    digest = hashlib.sha256()
    for section in sections:
        digest.update(section)
    header = {**fields, "digest": digest.hexdigest(), "splits": layout, "size": 0}
    while True:  # the header holds the file's size, which depends on the header's own length
        text = json.dumps(header, separators=(",", ":")).encode()
        block = len(MAGIC) + 8 + len(text)
        size = block + _pad(block) + position
        if size == header["size"]:
            break
        header["size"] = size
    prefix = MAGIC + len(text).to_bytes(8, "little") + text + b"\0" * _pad(block)
    return [prefix, *sections]


def read_header(buffer: Buffer) -> tuple[dict, int] | None:
    """The JSON header and where the arrays begin, or None where the bytes are not an index."""
    data = buffer.map
    if buffer.size < len(MAGIC) + 8 or data[:len(MAGIC)] != MAGIC:
        return None
    length = int.from_bytes(data[len(MAGIC):len(MAGIC) + 8], "little")
    block = len(MAGIC) + 8 + length
    if length > min(MAX_HEADER, buffer.size - len(MAGIC) - 8):
        return None
    try:
        header = json.loads(bytes(data[len(MAGIC) + 8:block]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(header, dict) or header.get("size") != buffer.size or not isinstance(header.get("splits"), dict):
        return None
    return header, block + _pad(block)


def _is_int(value: Any) -> bool:
    return type(value) is int and value >= 0


def decode_split(buffer: Buffer, base: int, entry: Any) -> tuple[list[str], PathArray, IntArray] | None:
    """One split's arrays, checked (bounds, types, order, label range), or None."""
    try:
        classes, count = entry["classes"], entry["count"]
        (names_at, names_size), (starts_at, starts_type), (labels_at, labels_type) = \
            entry["names"], entry["starts"], entry["labels"]
    except (TypeError, KeyError, ValueError):
        return None
    if not (isinstance(classes, list) and all(isinstance(c, str) for c in classes) and _is_int(count)
            and all(_is_int(v) for v in (names_at, names_size, starts_at, labels_at))
            and starts_type in OFFSET_TYPES and labels_type in LABEL_TYPES):
        return None
    starts_item, labels_item = np.dtype(starts_type).itemsize, np.dtype(labels_type).itemsize
    if (base + names_at + names_size > buffer.size or base + starts_at + (count + 1) * starts_item > buffer.size
            or base + labels_at + count * labels_item > buffer.size
            or (base + starts_at) % starts_item or (base + labels_at) % labels_item):
        return None
    paths = PathArray(buffer, base + names_at, names_size, base + starts_at, starts_type, count)
    labels = IntArray(buffer, base + labels_at, labels_type, count)
    starts = paths.starts
    if starts[0] != 0 or starts[-1] != names_size or not bool(np.all(starts[1:] > starts[:-1])):
        return None  # every name ends with its NUL: starts strictly increase
    if count and (int(labels.values.min()) < 0 or int(labels.values.max()) >= len(classes)):
        return None
    if not stays_inside(paths):
        return None
    return classes, paths, labels


def stays_inside(paths: PathArray) -> bool:
    """Whether every path stays inside its split folder: none is absolute and none has a ``..``
    component (a cache file written by another hand could list /etc/hostname or
    ../../home/someone/notes.txt). One pass over the names' bytes, no string per path."""
    if not len(paths):
        return True
    names = np.frombuffer(paths.names, dtype=np.uint8)
    if bool((names[paths.starts[:-1]] == ord("/")).any()):
        return False
    source, begin = paths.buffer.map, paths.layout[0]
    end = begin + paths.layout[1]
    at = source.find(b"..", begin, end)
    while at >= 0:  # ".." inside a name (a..b.jpg) is fine; as a whole component it is not
        before = source[at - 1] if at > begin else 0
        after = source[at + 2] if at + 2 < end else 0
        if before in (0, 0x2F) and after in (0, 0x2F):
            return False
        at = source.find(b"..", at + 1, end)
    return True


def decode_index(buffer: Buffer, splits: tuple[str, ...] = ("train", "val")) -> tuple[dict, dict] | None:
    """(header, {split: (classes, paths, labels)}) of a buffer in ``encode_index``'s layout, every
    bound and value checked; None where anything is off (a cache miss, never an error)."""
    found = read_header(buffer)
    if found is None:
        return None
    header, base = found
    decoded = {}
    for name in splits:
        split = decode_split(buffer, base, header["splits"].get(name))
        if split is None:
            return None
        decoded[name] = split
    return header, decoded


def share_buffer(buffer: Buffer | None, size: int, is_primary: bool, broadcast_object: Callable[[Any], Any],
                 allgather: Callable[[Any], Any] | None) -> tuple[Buffer | None, int]:
    """Rank 0's ``buffer`` (``size`` bytes) to the ranks that pass None, in anonymous memory; every
    rank calls it (collectives). Returns this rank's buffer and how many ranks received it.

    With ``allgather`` (of tensors: rank 0 gives the bytes, the others nothing) first a byte per
    rank says who needs it, then one collective per ``SEND_CHUNK``, only when some rank does.
    Without, ``broadcast_object`` of the bytes to all (slow: Horovod builds its tensor from them
    element by element, about 65 ns a byte; the count is then unknown: 0)."""
    if allgather is not None:
        import torch

        needed = int(allgather(torch.tensor([buffer is None], dtype=torch.uint8)).sum())
        if needed == 0:
            return buffer, 0

        def pieces() -> Iterator:
            for offset in range(0, size, SEND_CHUNK):
                count = min(SEND_CHUNK, size - offset)
                part = torch.from_numpy(buffer.array(offset, "u1", count).copy()) if is_primary else \
                    torch.empty(0, dtype=torch.uint8)
                yield allgather(part)[:count].numpy()
    else:
        needed = 0

        def pieces() -> Iterator:
            for offset in range(0, size, SEND_CHUNK):
                yield broadcast_object(bytes(buffer.map[offset:offset + SEND_CHUNK]) if is_primary else None)
    if buffer is not None:
        for _ in pieces():  # every rank takes part in every collective
            pass
        return buffer, needed
    return Buffer.in_memory(pieces()), needed


def host_budget(ranks_on_host: int, loaders: int, workers: int, list_bytes: int, shared: str) -> str:
    """The start-up line: loader workers on this host, and the file list they share."""
    total = ranks_on_host * loaders * workers
    size = f"{list_bytes / 1e6:.1f} MB" if list_bytes >= 1e6 else f"{list_bytes / 1e3:.1f} kB"
    return (f"host budget: {ranks_on_host} rank(s) x {loaders} loaders x {workers} workers = {total} loader "
            f"workers on this host, sharing a {size} file list ({shared})")
