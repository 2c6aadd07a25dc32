"""Uneven inputs ended with ``dist.join``: rank r allreduces 3 - r batches, then joins; then every
rank takes part in a broadcast (where a GPU build of Horovod without a GPU driver hangs under Gloo).
Prints one JSON line per rank: its sums, what join returned and the broadcast value."""

import json
import sys

import torch

from hvdtrain.comm import dist

dist.init(gpu=False)
rank = dist.rank()
sums = [float(dist.allreduce_sum(torch.tensor([rank + 1.0]), name=f"batch.{i}")[0]) for i in range(3 - rank)]
last = dist.join()
shared = dist.broadcast_object({"from": "rank 0"} if rank == 0 else None, name="after_join")
dist.barrier()
sys.stdout.write(json.dumps({"rank": rank, "sums": sums, "last": last, "shared": shared}) + "\n")
sys.stdout.flush()
