"""Python objects between the ranks of a job, for what is not a tensor (a file index, a stop
decision, metrics, the optimizer's state): encoded (comm/wire.py: JSON plus raw tensor bytes, never
a pickle, so nothing another process sends can run code) into one byte tensor that a collective or
two carries.
comm/dist.py offers them with the other collectives (``dist.broadcast_object``), over the engine
it runs (``engine``: comm/horovod_engine.py or comm/torch_engine.py, initialized by then, so its
rank and size are the job's)."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from ..config import ConfigError
from .wire import WireError, decode, encode


class ForeignObject(ConfigError):
    """Bytes from a rank that are not an object in comm/wire.py's format: the job stops (one line)."""


def allgather_object(obj: Any, engine: ModuleType, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (comm/wire.py's format).

    One allgather, where Horovod's own ``allgather_object`` takes two (the sizes, then the bytes) and
    builds its byte tensor one element at a time: each rank sends its encoding behind an 8-byte length,
    Horovod's allgather concatenates tensors of any length in rank order, and the lengths split the
    result again (the torch engine's allgather pads to the longest and cuts again). Every collective
    is a coordination round between the ranks (about 3-4 ms on 2 CPU
    ranks here), and a run gathers a few objects at the end of every epoch. The default name is
    the same on every rank (Horovod's, the object's type name, hangs where ranks send None and a
    value)."""
    name = "hvdtrain.allgather_object" if name is None else name
    data = encode(obj)
    mine = bytearray(len(data).to_bytes(8, "little"))
    mine += data
    gathered = engine.allgather(torch.frombuffer(mine, dtype=torch.uint8), name=f"{name}.framed").numpy().tobytes()
    objects, offset = [], 0
    while offset < len(gathered):
        length = int.from_bytes(gathered[offset:offset + 8], "little")
        objects.append(received(gathered[offset + 8:offset + 8 + length], len(objects), name))
        offset += 8 + length
    if len(objects) != engine.size():
        raise RuntimeError(f"allgather_object {name}: {len(objects)} objects for {engine.size()} ranks")
    return objects


def broadcast_object(obj: Any, engine: ModuleType, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (comm/wire.py's format).

    Horovod's own ``broadcast_object`` builds its byte tensor with ``torch.ByteTensor(bytearray(...))``,
    one element at a time: about 65 ns a byte, 13 s for 200 MB (a large file index, an optimizer's
    state). Here the encoding becomes a tensor over the same bytes (``torch.frombuffer``), and two
    broadcasts (size, then bytes) send it. The default name is the same on every rank: Horovod's,
    the object's type name, differs where only the root has the object (``x if is_primary else
    None``), and ranks waiting on differently named broadcasts wait forever. An empty encoding (never
    wire's) would skip the second broadcast on every rank alike."""
    name = "hvdtrain.broadcast_object" if name is None else name
    if engine.rank() == root_rank:
        data = bytearray(encode(obj))
        payload = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        engine.broadcast_(size, root_rank, name=f"{name}.sz")
    else:
        size = torch.zeros(1, dtype=torch.int64)
        engine.broadcast_(size, root_rank, name=f"{name}.sz")
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
    if payload.numel():
        engine.broadcast_(payload, root_rank, name=f"{name}.t")
    if engine.rank() == root_rank:
        return obj
    return received(payload.numpy().tobytes(), root_rank, name)


def received(data: bytes, sender: int, name: str) -> Any:
    """The object rank ``sender`` sent, decoded (never unpickled); one line where the bytes are not
    an object in comm/wire.py's format."""
    try:
        return decode(data)
    except WireError as error:
        raise ForeignObject(f"{name}: the object from rank {sender} is not in hvdtrain's format ({error}): "
                        "a process that is not one of this job's ranks may be sending; stopping") from None
