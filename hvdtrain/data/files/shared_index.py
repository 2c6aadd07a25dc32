"""One file index for every rank of a job: rank 0 builds it (or finds the layout problem, which
every rank then raises alike); a rank whose host has the same cache file maps it, the others get
rank 0's bytes (file_list.share_buffer). data/files/index.py builds, scans and caches an index."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .file_list import Buffer, read_header, share_buffer
from .index import FORMAT, SPLITS, DataError, FileIndex, LayoutError, build_index, cache_file, index_of


def describe(index: FileIndex) -> dict[str, Any]:
    """What rank 0 broadcasts: enough for another rank to find the same bytes, never the list."""
    return {**index.header, "source": index.source, "seconds": index.seconds, "root": index.root}


def matching_cache(root: Path, cache_dir: Path | None, wanted: dict[str, Any]) -> FileIndex | None:
    """This host's cache file when it holds exactly rank 0's index (same key, digest and size)."""
    if cache_dir is None or not wanted.get("key"):
        return None
    try:
        buffer = Buffer.of_file(cache_file(root, cache_dir))
        found = read_header(buffer)
    except (OSError, ValueError):
        return None
    if found is None or found[0].get("format") != FORMAT or \
            any(found[0].get(name) != wanted[name] for name in ("key", "digest", "size")):
        return None
    return index_of(buffer)


def receive(index: FileIndex | None, wanted: dict[str, Any], is_primary: bool,
            broadcast_object: Callable[[Any], Any], allgather: Callable[[Any], Any] | None) -> FileIndex:
    """This rank's index: its own, or rank 0's bytes where it has none (``file_list.share_buffer``)."""
    buffer, received_by = share_buffer(index.buffer if index is not None else None, wanted["size"], is_primary,
                                       broadcast_object, allgather)
    if index is not None:
        index.received_by = received_by
        return index
    received = index_of(buffer)
    if received is None or received.header["digest"] != wanted["digest"]:
        raise DataError("the file index received from rank 0 does not check out")
    return received


def shared_index(root: Path, cache_dir: Path | None, is_primary: bool,
                 broadcast_object: Callable[[Any], Any] | None = None,
                 splits: tuple[str, ...] = SPLITS, allgather: Callable[[Any], Any] | None = None) -> FileIndex:
    """Rank 0 builds the index (or finds the problem); every rank gets the same result.

    A layout problem is broadcast too, so that every rank raises the same one-line error instead
    of the other ranks waiting forever for rank 0. Without ``broadcast_object`` (elastic workers,
    which must not call collectives while joining) every process builds or loads it itself.
    ``allgather`` (the facade's, of tensors) sends the bytes to ranks that need them quickly.
    """
    result: tuple[str, Any] = ("error", "not built")
    index = None
    if is_primary or broadcast_object is None:
        try:
            index = build_index(root, cache_dir, splits)
            result = ("ok", describe(index))
        except LayoutError as error:
            result = ("error", str(error))
    if broadcast_object is None:
        if index is None:
            raise LayoutError(result[1])
        return index
    status, value = broadcast_object(result)
    if status != "ok":
        raise LayoutError(value)
    if not is_primary:
        index = matching_cache(root, cache_dir, value)
    index = receive(index, value, is_primary, broadcast_object, allgather)
    index.root, index.source, index.seconds = value["root"], value["source"], value["seconds"]
    return index
