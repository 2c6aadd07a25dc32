"""Reading tar shards member by member, for the shard loader's hot path.

``tarfile`` builds a ``TarInfo`` and a buffered file object for every member, which costs tens of
microseconds per member, twice per record (image and label), on top of decoding. This reader parses
the 512-byte headers itself (name, size, type, the header checksum) and reads or seeks over the
data, and it understands what writers put in WebDataset shards: ustar and GNU headers, GNU long
names and pax ``path`` records. Anything else that is not a regular file is skipped.
"""

from __future__ import annotations

import io
import os
from typing import BinaryIO, Iterator

BLOCK = 512
EMPTY = bytes(BLOCK)
# The largest member read into memory: a GNU long name or pax header (names are at most a few KB),
# and an image or label. A size in a header is a number in a file: beyond these it is a TarError,
# never an allocation of that size.
MAX_NAME_BYTES = 1 << 20
MAX_MEMBER_BYTES = 1 << 30
FILE_TYPES = (b"0", b"\0", b"7")       # regular file (old and new spelling), contiguous file
NAME_TYPES = (b"L", b"x")               # GNU long name, pax extended header: name the next member
SKIPPED_TYPES = (b"g", b"K")            # pax global header, GNU long link name: carry nothing we read


class TarError(ValueError):
    """A damaged or truncated tar stream."""


def number(field: bytes) -> int:
    """A header's numeric field: octal text, or GNU base-256 when the top bit is set."""
    if field[0] & 0x80:
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.strip(b"\0 ")
    try:
        return int(text, 8) if text else 0
    except ValueError:
        raise TarError(f"not a tar header (numeric field {field!r})") from None


def pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header (records are ``"<length> <key>=<value>\\n"``,
    the length counting the whole record). Every record must lie inside the header and be longer
    than its own length field, so each turn of the loop consumes input: a record such as
    ``0 foo=bar`` (length 0) used to loop forever; it is a TarError now, as anything malformed is."""
    at = 0
    while at < len(data):
        if data[at:].strip(b"\0") == b"":
            break  # the padding after the last record
        space = data.find(b" ", at, at + 21)  # a length of at most 20 digits
        digits = data[at:space] if space > at else b""
        if not digits.isdigit():
            raise TarError(f"malformed pax header record at byte {at}")
        length = int(digits)
        end = at + length
        if end <= space + 1 or end > len(data) or data[end - 1:end] != b"\n":
            raise TarError(f"malformed pax header record at byte {at} (length {length})")
        key, _, value = data[space + 1:end - 1].partition(b"=")
        if key == b"path":
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                raise TarError("pax path is not UTF-8") from None
        at = end
    return None


class TarReader:
    """Iterating yields ``(name, is_file)`` per member; ``read()`` returns the current member's data.
    Data not read is skipped (seeking when the stream can) when the iteration moves on."""

    def __init__(self, handle: BinaryIO):
        self.handle = handle
        self.size = 0       # the current member's data size
        self.left = 0       # bytes of the current member (data and padding) not consumed yet
        try:
            self.seekable = handle.seekable()
        except (AttributeError, OSError):
            self.seekable = False
        self.total = stream_size(handle)  # None where unknown: then MAX_MEMBER_BYTES alone bounds a read

    def read(self, limit: int = MAX_MEMBER_BYTES) -> bytes:
        """The current member's data, at most ``limit`` bytes (TarError beyond: a damaged header)."""
        if self.left < self.size + (-self.size) % BLOCK:
            raise TarError("member data read twice")
        if self.size > limit:
            raise TarError(f"member of {self.size} bytes, more than the {limit} read into memory (a damaged header?)")
        data = self.exactly(self.size)
        self.left -= self.size
        return data

    def exactly(self, count: int) -> bytes:
        data = self.handle.read(count)
        if len(data) != count:
            raise TarError(f"unexpected end of data ({len(data)} of {count} bytes)")
        return data

    def skip(self, count: int) -> None:
        if count and self.seekable:
            self.handle.seek(count, 1)
            return
        while count > 0:  # a stream: read and drop, a block at a time (a size in a header is no allocation)
            count -= len(self.exactly(min(count, 1 << 20)))

    def __iter__(self) -> Iterator[tuple[str, bool]]:
        name_next: str | None = None
        while True:
            self.skip(self.left)
            self.left = 0
            header = self.handle.read(BLOCK)
            if not header or header == EMPTY:
                return  # end of archive (two zero blocks, or a writer that left them out)
            if len(header) != BLOCK:
                raise TarError(f"unexpected end of data ({len(header)} of {BLOCK} header bytes)")
            if number(header[148:156]) != sum(header) - sum(header[148:156]) + 8 * 32:
                raise TarError("tar header checksum mismatch")
            kind = header[156:157]
            self.size = number(header[124:136])
            self.left = self.size + (-self.size) % BLOCK
            if self.total is not None and self.seekable and self.handle.tell() + self.size > self.total:
                raise TarError(f"unexpected end of data: a member of {self.size} bytes runs past the end of the file "
                               f"({self.total} bytes)")
            if kind in NAME_TYPES:
                data = self.read(MAX_NAME_BYTES)
                try:
                    name_next = data.rstrip(b"\0").decode("utf-8") if kind == b"L" else pax_path(data) or name_next
                except UnicodeDecodeError:
                    raise TarError("a long name that is not UTF-8") from None
                continue
            if kind in SKIPPED_TYPES:
                continue
            name = name_next or ustar_name(header)
            name_next = None
            yield (name.rstrip("/") if kind == b"5" else name), kind in FILE_TYPES


def stream_size(handle: BinaryIO) -> int | None:
    """The size of the file behind ``handle`` (a local file's, fsspec's ``size``, or a seekable
    stream's end), or None."""
    try:
        return os.fstat(handle.fileno()).st_size
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
        pass
    size = getattr(handle, "size", None)
    if isinstance(size, int):
        return size
    try:
        if handle.seekable():
            here = handle.tell()
            end = handle.seek(0, io.SEEK_END)
            handle.seek(here)
            return end
    except (AttributeError, OSError, ValueError):
        pass
    return None


def ustar_name(header: bytes) -> str:
    name = header[:100].split(b"\0", 1)[0]
    if header[257:263] == b"ustar\0" and header[345] != 0:  # POSIX ustar's prefix (GNU keeps times there)
        name = header[345:500].split(b"\0", 1)[0] + b"/" + name
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise TarError("a member name that is not UTF-8") from None
