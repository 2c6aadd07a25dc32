"""hvdtrain's object collectives between real ranks (comm/dist.py): allgather_object in one
allgather (each encoding framed by its length), broadcast_object, their default names (the same on
every rank), and the one-integer broadcast a checkpoint's outcome uses, under horovodrun (Gloo)
and mpirun on 3 ranks. A pickle that a peer sends in place of an object is refused on every rank
in one line, and runs nothing: the file its payload would create does not exist."""

from __future__ import annotations

import re

import pytest

from tests.helpers import launch

SCRIPT = """
import os
import pickle
import sys
import torch
from hvdtrain.comm import dist, objects

dist.init(gpu=False)
rank, size = dist.rank(), dist.size()
# Objects of very different lengths per rank (empty, small, 300 KB), a tensor and None among them.
mine = {"rank": rank, "text": "x" * (150_000 * rank), "tensor": torch.arange(rank + 1), "none": None, "empty": b""}
for round_ in range(3):  # the same name again and again, as at the end of every epoch
    gathered = dist.allgather_object(mine, name="probe")
    assert [item["rank"] for item in gathered] == list(range(size)), gathered
    assert [len(item["text"]) for item in gathered] == [150_000 * r for r in range(size)]
    assert all(torch.equal(item["tensor"], torch.arange(r + 1)) for r, item in enumerate(gathered))
    assert all(item["none"] is None and item["empty"] == b"" for item in gathered)
# Default names: the same on every rank whatever each sends (Horovod's, the type's name, would hang).
assert dist.allgather_object(rank if rank else None) == [None, *range(1, size)]
assert dist.broadcast_object(b"only the root has it" if rank == 0 else None) == b"only the root has it"
assert dist.broadcast_object({"from": rank}, root_rank=size - 1, name="probe.b") == {"from": size - 1}
flag = dist.broadcast(torch.tensor([7 if rank == 0 else 0], dtype=torch.int32), name="probe.flag")
assert int(flag[0]) == 7


class Plant:  # unpickled, it would create the marker file
    def __reduce__(self):
        return (os.system, ("touch " + sys.argv[1],))


# Rank 1 sends a pickle, framed as an object: every rank receives it as the object collective does.
data = pickle.dumps(Plant()) if rank == 1 else b"{}"
framed = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)
gathered = dist.allgather(framed, name="probe.pickle").numpy().tobytes()
first = 8 + int.from_bytes(gathered[:8], "little")  # rank 1's frame follows rank 0's
length = int.from_bytes(gathered[first:first + 8], "little")
try:
    objects.received(gathered[first + 8:first + 8 + length], 1, "probe")
    raise SystemExit("a pickle was accepted")
except objects.ForeignObject as error:
    assert "from rank 1 is not in hvdtrain's format" in str(error) and "\\n" not in str(error), error
assert not os.path.exists(sys.argv[1])
sys.stdout.write(f"rank {rank} of {size}: ok\\n")  # one write: mpirun may interleave the two writes of print()
sys.stdout.flush()
"""


@pytest.mark.parametrize("kind", ["horovodrun-gloo", "mpirun"])
def test_objects_of_any_length_gather_in_rank_order_in_one_collective(kind, tmp_path):
    marker = tmp_path / "code-ran"
    result = launch(kind, 3, ["-c", SCRIPT, str(marker)], tmp_path, timeout=300)
    assert not marker.exists()
    output = result.stdout + result.stderr
    # Found anywhere in the output, not per line: a launcher may still put another rank's bytes in a line.
    assert sorted(re.findall(r"rank (\d) of 3: ok", output)) == ["0", "1", "2"], output[-3000:]
