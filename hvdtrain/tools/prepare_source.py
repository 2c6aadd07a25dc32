"""``hvdtrain prepare``'s reading of the source: each file opened once, checked on that descriptor,
and read from it.

Links are followed as ImageFolder follows them, but a file reached through a link that leaves SRC
is refused with one line unless ``--follow-links`` (in a folder others can write, a link to a
private key would otherwise land in a shard). ``outside_links`` names such links before anything
is written; that check alone would be check-then-use: another user of a shared source folder can
swap ``0.png`` for a link to a private file once it is done. So every file is then opened once
(``O_NOFOLLOW`` first), and where the descriptor leads (``/proc/self/fd``, which no rename or link
can change after the open) must lie inside SRC; the bytes that go into a shard are read from that
descriptor, never from the path again.
"""

from __future__ import annotations

import errno
import io
import os
import stat

from ..data.files.index import DataError

# What Pillow may identify a source file as (file_index.IMG_EXTENSIONS' formats; MPO: a JPEG with
# extra frames, as cameras write). Anything else is skipped, never copied into a shard.
IMAGE_FORMATS = {"JPEG", "MPO", "PNG", "PPM", "BMP", "TIFF", "WEBP"}
PROC_FD = "/proc/self/fd"  # where each open descriptor of this process leads


class LeftSource(DataError):
    """A source file that leads outside SRC when it is opened (swapped for a link after the scan)."""


def member_ext(path: str) -> str:
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    return "jpg" if ext == "jpeg" else ext


def outside_links(src, split: str, paths: list[str]) -> list[tuple[str, str]]:
    """(path, target) of the listed files that are, or lie under, a link to somewhere outside
    ``src`` (resolved). One realpath per folder, and one per file that is itself a link."""
    inside = str(src) + os.sep
    by_folder: dict[str, list[str]] = {}
    for path in paths:
        folder, name = os.path.split(path)
        by_folder.setdefault(folder, []).append(name)
    found = []
    for folder, names in by_folder.items():
        where = src / split / folder
        real = os.path.realpath(where)
        if not (real + os.sep).startswith(inside):
            found += [(str(where / name), os.path.join(real, name)) for name in names]
            continue
        try:
            links = {entry.name for entry in os.scandir(where) if entry.is_symlink()}
        except OSError:
            continue
        for name in set(names) & links:
            target = os.path.realpath(where / name)
            if not target.startswith(inside):
                found.append((str(where / name), target))
    return sorted(found)


def left_source(path: str, target: str, inside: str) -> LeftSource:
    return LeftSource(f"{path} leads outside {inside.rstrip(os.sep)} (to {target}) since the scan: another user "
                      f"changed the source during prepare? Nothing of it was read; check the source folder, and run "
                      f"prepare again")


def open_source(path: str, inside: str | None) -> int:
    """A descriptor of the source file ``path``, opened once (``O_NONBLOCK``: a FIFO never blocks the
    open) and checked on that descriptor: a regular file and, unless ``inside`` is None
    (``--follow-links``), one that lies under the folder ``inside`` (ending in os.sep). A file that is
    not a link is opened with ``O_NOFOLLOW``, so that one swapped for a link since is not followed
    blindly: a link is opened again, following it, and where the descriptor leads (``/proc/self/fd``)
    decides. LeftSource where it leads outside; OSError where it cannot be read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    if inside is None:
        descriptor = os.open(path, flags)
    else:
        try:
            descriptor = os.open(path, flags | os.O_NOFOLLOW)
        except OSError as error:
            if error.errno != errno.ELOOP:
                raise
            if not os.path.isdir(PROC_FD):  # where the link leads cannot be checked on a descriptor
                raise left_source(path, os.path.realpath(path), inside) from None
            descriptor = os.open(path, flags)  # a link: checked below, on what was opened
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if inside is not None and os.path.isdir(PROC_FD):
            where = os.readlink(f"{PROC_FD}/{descriptor}")
            if not where.startswith(inside):
                raise left_source(path, where, inside)
    except BaseException:
        os.close(descriptor)
        raise
    return descriptor


def read_source(path: str, inside: str | None) -> bytes:
    """The bytes of the source file ``path``, read from the one descriptor ``open_source`` checked."""
    with os.fdopen(open_source(path, inside), "rb") as handle:
        return handle.read()


def encode(path: str, max_side: int, quality: int, inside: str | None = None) -> tuple[bytes, str]:
    """The bytes and extension stored for one source file, which must be an image (its header
    parses as one of IMAGE_FORMATS, ``Image.verify`` passes).

    Without ``max_side`` (or when the image already fits) the original bytes, untouched; otherwise
    the image downscaled so that its longer side is ``max_side`` (Pillow's reducing draft + Lanczos),
    re-encoded as RGB JPEG at ``quality``. OSError: unreadable file; ValueError: not an image;
    LeftSource: the file leads outside ``inside`` (``open_source``).
    """
    data = read_source(path, inside)
    if not data:
        raise ValueError("empty file")
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            # Only images go into a shard, copied or not: a key or a text file named .jpg is skipped.
            if image.format not in IMAGE_FORMATS:
                raise ValueError(f"not an image ({image.format} data)")
            if not max_side or max(image.size) <= max_side:
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
        raise ValueError(f"not an image: {type(error).__name__}: {error}") from None
