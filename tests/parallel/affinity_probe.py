"""Where a run's threads are allowed to run (runtime.cpu_affinity), for tests/parallel/test_placement.py.

Usage (under a launcher): affinity_probe.py [key=value ...]; with AFFINITY_PROBE_HOLD=FILE in the
environment, each rank stays up, bound, until FILE exists. Sets a tiny synthetic run up as
training does (hvdtrain.train.run.setup: Horovod's threads, the loaders, the model) and prints one JSON
line per rank: the cores each of its threads may run on, and torch's thread count.
"""

import json
import os
import sys
import time

import torch

from hvdtrain.comm import dist
from hvdtrain.job_config import load_config
from hvdtrain.train.run import setup

cfg = load_config(None, ["data.synthetic=true", "model.arch=resnet18", "data.image_size=32", "train.batch_size=4",
                         "output.tensorboard=false", "runtime.stats_interval=0", *sys.argv[1:]])
run = setup(cfg)
threads = {tid: sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
line = json.dumps({"rank": dist.rank(), "local_rank": dist.local_rank(), "torch_threads": torch.get_num_threads(),
                   "threads": threads})
sys.stdout.write(line + "\n")  # one write: mpirun may interleave the two writes of print()
sys.stdout.flush()
hold = os.environ.get("AFFINITY_PROBE_HOLD")  # a file: stay bound until it exists (a job already running)
deadline = time.monotonic() + 300
while hold and not os.path.exists(hold) and time.monotonic() < deadline:
    time.sleep(0.2)
dist.shutdown()
