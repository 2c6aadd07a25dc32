"""The format objects travel in between the ranks of a job (comm/objects.py): JSON plus raw
tensor bytes, never a pickle. Decoding it builds JSON values, tuples, sets, bytes, tensors and
numpy arrays of plain numeric dtypes, and nothing else: no constructor or function is named by
the data, so bytes from another process (a rank, or whoever reached the job's port) cannot run
code here; at worst they are refused as malformed.

Layout: ``HVDW1``, the JSON header's length (8 bytes, little-endian), the header, then the raw
bytes of every bytes/tensor/array value, which the header points into (offset, length). Values
that JSON has no type for are tagged objects ``{"$": kind, ...}``: a tuple, a set, a dict whose
keys are not all strings (or that has a "$" key), a non-finite float, bytes, a tensor (dtype,
shape, device type), a numpy array or scalar. A subclass that would arrive as its base type
and lose its meaning (a str with attributes, a named tuple) is refused when sent: the sender
turns it into plain values (e.g. data/files/bad_files.fields)."""

from __future__ import annotations

import enum
import json
import math
import re
from typing import Any

import numpy as np
import torch

MAGIC = b"HVDW1"
TAG = "$"
# Tensor dtypes that may travel: plain numbers, by torch's own name ("float32").
TENSOR_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}
NUMPY_DTYPE = re.compile(r"^[<>|=][biufc][0-9]{1,2}$")  # numpy's dtype.str of a plain number
NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class WireError(ValueError):
    """Bytes that are not an object in this format (or promise more than they hold)."""


def encode(obj: Any) -> bytes:
    """``obj`` as bytes; TypeError (naming the type) for a value the format has no kind for."""
    blobs: list[bytes] = []
    offset = [0]

    def blob(data: bytes) -> list[int]:
        blobs.append(data)
        offset[0] += len(data)
        return [offset[0] - len(data), len(data)]

    def tree(value: Any) -> Any:
        if value is None or type(value) in (bool, str):
            return value
        if type(value) is int or isinstance(value, enum.Enum) and isinstance(value, int):
            return int(value)  # an IntEnum or IntFlag travels as its number
        if isinstance(value, float):
            return float(value) if math.isfinite(value) else {TAG: "float", "v": repr(float(value))}
        if isinstance(value, list):
            return [tree(item) for item in value]
        if type(value) is tuple or isinstance(value, torch.Size):
            return {TAG: "tuple", "v": [tree(item) for item in value]}
        if isinstance(value, (set, frozenset)):
            return {TAG: "set", "v": [tree(item) for item in value]}
        if isinstance(value, dict):
            if all(isinstance(key, str) for key in value) and TAG not in value:
                return {str(key): tree(item) for key, item in value.items()}
            return {TAG: "dict", "v": [[tree(key), tree(item)] for key, item in value.items()]}
        if isinstance(value, (bytes, bytearray, memoryview)):
            return {TAG: "bytes", "at": blob(bytes(value))}
        if isinstance(value, torch.Tensor):
            return tensor_tree(value, blob)
        if isinstance(value, np.ndarray) and NUMPY_DTYPE.match(value.dtype.str):
            return {TAG: "ndarray", "dtype": value.dtype.str, "shape": list(value.shape),
                    "at": blob(np.ascontiguousarray(value).tobytes())}
        if isinstance(value, np.generic) and NUMPY_DTYPE.match(value.dtype.str):
            return {TAG: "npscalar", "dtype": value.dtype.str, "v": tree(value.item())}
        raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__} cannot be sent between ranks: "
                        "objects between ranks are JSON values, tuples, sets, bytes, tensors and numpy arrays "
                        "(a format that cannot carry code); send its plain values instead")

    header = json.dumps(tree(obj), separators=(",", ":"), allow_nan=False).encode()
    out = bytearray(MAGIC)
    out += len(header).to_bytes(8, "little")
    out += header
    for data in blobs:
        out += data
    return bytes(out)


def tensor_tree(value: torch.Tensor, blob) -> dict[str, Any]:
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in TENSOR_DTYPES or value.layout != torch.strided:
        raise TypeError(f"a {value.layout} tensor of {value.dtype} cannot be sent between ranks as an object: "
                        f"send a dense tensor of {', '.join(TENSOR_DTYPES)}")
    flat = value.detach().to("cpu").contiguous().reshape(-1)
    return {TAG: "tensor", "dtype": dtype, "shape": list(value.shape), "device": value.device.type,
            "at": blob(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")}


def decode(data: bytes | bytearray | memoryview) -> Any:
    """The object ``encode`` made; WireError for anything else (never runs code)."""
    view = memoryview(data).cast("B")
    if bytes(view[:len(MAGIC)]) != MAGIC or len(view) < len(MAGIC) + 8:
        raise WireError("it does not start with this format's mark")
    length = int.from_bytes(view[len(MAGIC):len(MAGIC) + 8], "little")
    start = len(MAGIC) + 8 + length
    if start > len(view):
        raise WireError(f"its header claims {length} bytes, more than it holds")
    try:
        header = json.loads(bytes(view[len(MAGIC) + 8:start]))
    except (ValueError, RecursionError) as error:
        raise WireError(f"its header is not JSON ({type(error).__name__})") from None
    blobs = view[start:]

    def piece(at: Any) -> memoryview:
        if not (isinstance(at, list) and len(at) == 2 and all(type(n) is int and n >= 0 for n in at)
                and at[0] + at[1] <= len(blobs)):
            raise WireError(f"a value points outside the data ({at!r})")
        return blobs[at[0]:at[0] + at[1]]

    def shape_of(node: dict, itemsize: int, nbytes: int) -> list[int]:
        shape = node.get("shape")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)) \
                or math.prod(shape) * itemsize != nbytes:
            raise WireError(f"a shape {shape!r} does not fit its {nbytes} bytes")
        return shape

    def value(node: Any) -> Any:
        if isinstance(node, list):
            return [value(item) for item in node]
        if not isinstance(node, dict):
            return node
        if TAG not in node:
            return {key: value(item) for key, item in node.items()}
        kind = node[TAG]
        if kind in ("tuple", "set", "dict") and not isinstance(node.get("v"), list):
            raise WireError(f"a {kind} without its items")
        if kind == "tuple":
            return tuple(value(item) for item in node["v"])
        if kind == "set":
            return set(value(item) for item in node["v"])
        if kind == "dict":
            if not all(isinstance(pair, list) and len(pair) == 2 for pair in node["v"]):
                raise WireError("a dict item is not a pair")
            return {value(key): value(item) for key, item in node["v"]}
        if kind == "float" and node.get("v") in NON_FINITE:
            return NON_FINITE[node["v"]]
        if kind == "bytes":
            return bytes(piece(node.get("at")))
        if kind == "tensor" and node.get("dtype") in TENSOR_DTYPES:
            dtype = TENSOR_DTYPES[node["dtype"]]
            raw = piece(node.get("at"))
            shape = shape_of(node, torch.empty(0, dtype=dtype).element_size(), len(raw))
            tensor = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8).copy()).view(dtype).reshape(shape) \
                if len(raw) else torch.empty(shape, dtype=dtype)
            if node.get("device") == "cuda" and torch.cuda.is_available():
                tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
            return tensor
        if kind in ("ndarray", "npscalar") and isinstance(node.get("dtype"), str) and NUMPY_DTYPE.match(node["dtype"]):
            dtype = np.dtype(node["dtype"])
            if kind == "npscalar":
                return dtype.type(value(node.get("v")))
            raw = piece(node.get("at"))
            shape = shape_of(node, dtype.itemsize, len(raw))
            return np.frombuffer(raw, dtype=np.uint8).copy().view(dtype).reshape(shape)
        raise WireError(f"an unknown kind of value ({str(kind)[:40]!r})")

    try:
        return value(header)
    except RecursionError:
        raise WireError("it nests deeper than Python can follow") from None
    except (TypeError, ValueError, OverflowError, RuntimeError) as error:
        if isinstance(error, WireError):
            raise
        raise WireError(f"a value does not check out ({type(error).__name__}: {str(error)[:80]})") from None
