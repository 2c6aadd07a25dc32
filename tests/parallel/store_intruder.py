"""A process that is not one of a torch-engine job's ranks, run by tests/parallel/test_store_security.py
(as a second Unix user where the suite can make one). It attacks the job's store at 127.0.0.1:PORT
both ways an attacker without the job's secret could:

- as torch.distributed (what worked before the store was authenticated): it joins as a rank, or
  listens first on the port as rank 0, and sends a pickle, framed as hvdtrain's object collectives
  frame an object, in the allgather every rank starts with;
- as comm/job_store.py's handshake read from the source: ``rank1`` claims rank 1 and answers rank 0's
  nonce with a made-up HMAC; ``impostor`` answers a rank's challenge with one.

Unpickled, the pickle creates MARKER: the test asserts it does not exist. With UID, started as
root, it becomes that user (and group) right after its imports, before it opens a socket: the
interpreter may lie in a folder only root can enter.

    store_intruder.py rank1|impostor PORT MARKER [UID GID]
"""

from __future__ import annotations

import datetime
import json
import os
import pickle
import secrets
import sys
import threading

import torch
import torch.distributed as tdist

MODE, PORT, MARKER = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if len(sys.argv) > 5:
    os.setgroups([])
    os.setgid(int(sys.argv[5]))
    os.setuid(int(sys.argv[4]))
AUTH = "hvdtrain/auth/"
WAIT = datetime.timedelta(seconds=120)


class Plant:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def handshake() -> None:
    store = tdist.TCPStore("127.0.0.1", PORT, 2, False, WAIT)
    made_up = secrets.token_hex(32)
    if MODE == "rank1":
        claim = store.add(f"{AUTH}claims/1", 1)
        store.set(f"{AUTH}hello/1/{claim}", json.dumps({"nonce": secrets.token_hex(16), "host": "intruder",
                                                         "pid": os.getpid()}))
        store.wait([f"{AUTH}answer/1/{claim}"])
        store.set(f"{AUTH}proof/1/{claim}", made_up)
        print("intruder: answered with a made-up proof", flush=True)
        store.wait([f"{AUTH}verdict"])  # connected while rank 0 names who is
    else:
        store.wait([f"{AUTH}hello/1/1"])
        store.set(f"{AUTH}answer/1/1", json.dumps({"nonce": secrets.token_hex(16), "mac": made_up}))
        store.set(f"{AUTH}verdict", pickle.dumps(Plant()))
        print("impostor: answered with a made-up proof", flush=True)


def as_a_rank() -> None:
    rank = 1 if MODE == "rank1" else 0
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{PORT}", rank=rank, world_size=2, timeout=WAIT)
    data = pickle.dumps(Plant())
    framed = torch.frombuffer(bytearray(len(data).to_bytes(8, "little") + data), dtype=torch.uint8)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    tdist.all_gather(lengths, torch.tensor([framed.numel()]))
    padded = torch.zeros(int(max(lengths)), dtype=torch.uint8)
    padded[:framed.numel()] = framed
    tdist.all_gather([torch.empty_like(padded) for _ in range(2)], padded)
    print("intruder: sent a pickle", flush=True)


threading.Thread(target=handshake, daemon=True).start()
as_a_rank()
