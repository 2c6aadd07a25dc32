"""A job where rank 1 is late to a collective, under Horovod's stall inspector as hvdtrain sets it.

    python stall_probe.py WARNING_SECONDS SHUTDOWN_SECONDS LATE_SECONDS

Rank 0 submits an allreduce at once; rank 1 sleeps LATE_SECONDS first. Prints "done" per rank
when the allreduce completes.
"""

from __future__ import annotations

import sys
import time

import torch

from hvdtrain.comm import dist

warning, shutdown, late = (int(arg) for arg in sys.argv[1:4])
dist.init(gpu=False, stall_warning_seconds=warning, stall_shutdown_seconds=shutdown)
if dist.rank() == 1:
    time.sleep(late)
total = dist.allreduce_sum(torch.ones(4), name="late_tensor")
sys.stdout.write(f"rank {dist.rank()} done: {float(total[0])}\n")
