"""comm/wire.py: objects between ranks travel as JSON plus raw tensor bytes. Every kind the
trainer sends comes back equal (a real optimizer and GradScaler state, random generator states,
the file index's tuples and bytes); a pickle, or any byte string that is not this format, is
refused without running anything (a payload that would create a marker file leaves none)."""

from __future__ import annotations

import collections
import enum
import math
import os
import pickle

import numpy as np
import pytest
import torch

from hvdtrain.comm import objects, wire
from hvdtrain.data.files.bad_files import BadFile, fields
from hvdtrain.train.state import rng_state


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return type(b) is dict and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def round_trip(obj):
    return wire.decode(wire.encode(obj))


def test_plain_values_and_tagged_kinds_come_back_equal():
    values = [None, True, 0, -(2 ** 70), 1.5, math.inf, -math.inf, "é", b"\x00\xff" * 3, (1, (2, "x")),
              [1, [2, None]], {"a": 1, "$": 2}, {1: "one", (2, 3): "pair"}, {3, 4}, np.int64(7), np.float32(0.5),
              {"nested": {"t": torch.arange(6, dtype=torch.int16).reshape(2, 3)}}]
    for value in values:
        assert same(value, round_trip(value)), value
    assert math.isnan(round_trip(math.nan))
    assert round_trip(b"") == b""
    assert round_trip(torch.empty(0, 4)).shape == (0, 4)
    assert round_trip(torch.tensor(3.25)).shape == ()


def test_the_state_a_resume_broadcasts_comes_back_equal():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9))
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(), "rng": rng_state(),
             "position": {"epoch": 3, "step": 41}, "bf16": torch.ones(3, dtype=torch.bfloat16),
             "flags": torch.tensor([True, False])}
    back = round_trip(state)
    assert same(state, back)
    restored = torch.optim.AdamW(torch.nn.Linear(4, 3).parameters(), lr=1.0)
    restored.load_state_dict(back["optimizer"])
    assert restored.param_groups[0]["betas"] == (0.8, 0.9) and restored.param_groups[0]["lr"] == 0.1
    assert torch.equal(restored.state[restored.param_groups[0]["params"][0]]["exp_avg"],
                       optimizer.state[optimizer.param_groups[0]["params"][0]]["exp_avg"])


def test_a_value_that_could_carry_code_is_refused_by_name():
    class Custom:
        pass

    for bad in (Custom(), print, object()):
        with pytest.raises(TypeError, match="cannot be sent between ranks"):
            wire.encode({"x": [bad]})
    with pytest.raises(TypeError, match="cannot be sent between ranks"):
        wire.encode(np.array([object()]))
    # a subclass that would arrive as its base type, without its meaning: the sender sends plain values
    record = BadFile("a.png", "missing", "FileNotFoundError")
    with pytest.raises(TypeError, match="BadFile cannot be sent"):
        wire.encode([record])
    assert BadFile(*round_trip(fields(record))).reason == "missing"
    with pytest.raises(TypeError, match="Pair cannot be sent"):
        wire.encode(collections.namedtuple("Pair", "a b")(1, 2))
    assert round_trip(enum.IntFlag("Update", "added removed").removed) == 2
    assert round_trip(torch.Size([2, 3])) == (2, 3)


class Plant:
    """Unpickling it would create the marker file: a stand-in for code run by a peer's bytes."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_pickle_from_a_peer_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(Plant(str(marker)))
    for data in (payload, wire.MAGIC + payload, wire.MAGIC + len(payload).to_bytes(8, "little") + payload):
        with pytest.raises(wire.WireError):
            wire.decode(data)
    with pytest.raises(objects.ForeignObject, match="from rank 1 is not in hvdtrain's format.*stopping"):
        objects.received(payload, 1, "hvdtrain.hosts")
    assert not marker.exists()
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("header, blob", [
    ({"$": "tensor", "dtype": "float32", "shape": [4], "at": [0, 8]}, b"\0" * 8),      # shape larger than bytes
    ({"$": "tensor", "dtype": "object", "shape": [1], "at": [0, 1]}, b"\0"),          # no such dtype
    ({"$": "ndarray", "dtype": "|O8", "shape": [1], "at": [0, 8]}, b"\0" * 8),        # numpy objects
    ({"$": "bytes", "at": [4, 10 ** 12]}, b"1234"),                                    # outside the data
    ({"$": "bytes", "at": [-1, 1]}, b"1234"),
    ({"$": "dict", "v": [[[1], 2]]}, b""),                                             # unhashable key
    ({"$": "posix.system", "v": ["touch x"]}, b""),                                    # unknown kind
    ({"$": "float", "v": "1e999"}, b""),
])
def test_malformed_or_hostile_bytes_are_refused(header, blob):
    import json
    text = json.dumps(header).encode()
    with pytest.raises(wire.WireError):
        wire.decode(wire.MAGIC + len(text).to_bytes(8, "little") + text + blob)


def test_deep_nesting_and_a_lying_length_are_refused():
    deep = b"[" * 100000 + b"]" * 100000
    with pytest.raises(wire.WireError):
        wire.decode(wire.MAGIC + len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(wire.WireError, match="claims"):
        wire.decode(wire.MAGIC + (10 ** 9).to_bytes(8, "little") + b"{}")
