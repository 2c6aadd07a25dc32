"""How long an allreduce that every rank submits at once takes, with a long Horovod cycle.

    python cycle_probe.py CYCLE_MS [WAKE]

Sets HOROVOD_CYCLE_TIME=CYCLE_MS (and HOROVOD_CYCLE_WAKE_ON_ENQUEUE=WAKE when given; otherwise
hvdtrain's default applies), then runs 6 small allreduces one after the other and prints the
median time of one. Horovod's background thread sleeps out each cycle: unpatched, a tensor waits
for the next cycle (half a cycle on average). With third_party/horovod/0003 and the wake
on, the cycle starts when the tensor arrives.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

from hvdtrain.comm import dist

os.environ["HOROVOD_CYCLE_TIME"] = sys.argv[1]
if len(sys.argv) > 2:
    os.environ["HOROVOD_CYCLE_WAKE_ON_ENQUEUE"] = sys.argv[2]
dist.init(gpu=False)
dist.allreduce_sum(torch.ones(4), name="warm_up")
times = []
for index in range(6):
    began = time.perf_counter()
    total = dist.allreduce_sum(torch.ones(4), name=f"tensor_{index}")
    times.append(time.perf_counter() - began)
    assert float(total[0]) == dist.size()
sys.stdout.write(f"rank {dist.rank()}: median allreduce {statistics.median(times):.3f} s "
                 f"(wake {os.environ.get('HOROVOD_CYCLE_WAKE_ON_ENQUEUE', 'unset')})\n")
