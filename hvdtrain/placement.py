"""Where a rank's threads run on a CPU host (runtime.cpu_affinity).

horovodrun --gloo, and mpirun -bind-to none, start every rank of a host on all of its cores, and
the scheduler then moves each rank's compute thread, Horovod's background thread and Gloo's I/O
thread from core to core, away from their caches. With affinity "rank", every rank of a host takes
its own block of the cores it was started on (local rank 0 the first block) and binds all of its
threads there; threads and loader workers started later inherit it. The cores are taken in the
order of the machine's topology (NUMA node, package, physical core), so that a block holds whole
physical cores, hyperthread siblings together, on as few NUMA nodes as it can: Linux numbers the
second hyperthread of every core after all the first ones, and halving 0..2N-1 in numeric order
would give each of 2 ranks one thread of every core. A launcher that already bound the ranks
(mpirun's default -bind-to core, srun --cpu-bind) gives them different sets of cores: those are
left alone.
"""
from __future__ import annotations

import os
from pathlib import Path

from . import dist, launcher

CPU_SYSFS = Path("/sys/devices/system/cpu")


def topology_key(cpu: int, sysfs: Path | None = None) -> tuple[int, int, int, int]:
    """(NUMA node, package, physical core, cpu) of a logical CPU, from sysfs (0s where it says nothing)."""
    base = (sysfs or CPU_SYSFS) / f"cpu{cpu}"
    nodes = sorted(int(entry.name[4:]) for entry in base.glob("node[0-9]*")) if base.is_dir() else []

    def number(name: str) -> int:
        try:
            return int((base / "topology" / name).read_text())
        except (OSError, ValueError):
            return 0

    return (nodes[0] if nodes else 0, number("physical_package_id"), number("core_id"), cpu)


def topology_order(cores: list[int], sysfs: Path | None = None) -> list[int]:
    return sorted(cores, key=lambda cpu: topology_key(cpu, sysfs))


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
    mine = sorted(split_cores(topology_order(started_on), dist.local_rank(), dist.local_size()))
    bind_threads(mine)
    return mine
