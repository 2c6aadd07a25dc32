"""Where a rank's threads run on a CPU host (runtime.cpu_affinity).

horovodrun --gloo, and mpirun -bind-to none, start every rank of a host on all of its cores, and
the scheduler then moves each rank's compute thread, Horovod's background thread and Gloo's I/O
thread from core to core, away from their caches. With affinity "rank", every rank of a host takes
its own block of the cores it was started on (local rank 0 the first block) and binds all of its
threads there; threads and loader workers started later inherit it. A launcher that already bound
the ranks (mpirun's default -bind-to core, srun --cpu-bind) gives them different sets of cores:
those are left alone.
"""
from __future__ import annotations

import os

from . import dist, launcher


def split_cores(cores: list[int], local_rank: int, local_size: int) -> list[int]:
    """Local rank's block of ``cores``, split in order into ``local_size`` blocks (the first ranks take
    one core more when they do not divide evenly)."""
    share, extra = divmod(len(cores), local_size)
    start = local_rank * share + min(local_rank, extra)
    return cores[start:start + share + (1 if local_rank < extra else 0)]


def bind_threads(cores: list[int]) -> None:
    """Every thread of this process onto ``cores`` (sched_setaffinity applies to one thread)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def place_rank(mode: str, device_type: str, elastic: bool) -> list[int] | None:
    """Binds this rank's threads to its block of the host's cores and returns it, or None where the
    threads stay where the launcher put them. A collective (every rank calls it) unless off."""
    if mode == "none" or (mode == "auto" and (device_type != "cpu" or elastic)):
        return None
    if not hasattr(os, "sched_setaffinity"):
        return None
    started_on = sorted(os.sched_getaffinity(0))
    host = launcher.host_name()
    everyone = dist.allgather_object((host, started_on), name="hvdtrain.cpu_affinity")
    if any(cores != started_on for other, cores in everyone if other == host):
        return None  # the launcher bound the ranks already
    if len(started_on) < dist.local_size():
        return None  # fewer cores than ranks: no block for every rank
    mine = split_cores(started_on, dist.local_rank(), dist.local_size())
    bind_threads(mine)
    return mine
