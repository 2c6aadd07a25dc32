"""A job where rank 1 is late to an allreduce: how much CPU rank 0's training thread spends waiting.

    python wait_probe.py LATE_SECONDS

Rank 1 sleeps LATE_SECONDS before its allreduce. Rank 0 submits at once and blocks in Horovod's
``synchronize``; it prints the wall time of that wait and the CPU time its own thread used during
it (``time.thread_time``: Horovod's background and transport threads are not counted).
"""

from __future__ import annotations

import sys
import time

import torch

from hvdtrain.comm import dist

late = float(sys.argv[1])
dist.init(gpu=False)
dist.allreduce_sum(torch.ones(4), name="warm_up")
if dist.rank() == 1:
    time.sleep(late)
wall, cpu = time.perf_counter(), time.thread_time()
total = dist.allreduce_sum(torch.ones(4), name="late_tensor")
wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
sys.stdout.write(f"rank {dist.rank()} waited {wall:.3f} s wall, {cpu:.3f} s thread CPU, sum {float(total[0]):g}\n")
