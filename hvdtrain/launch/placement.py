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

Cores are a shared resource: two jobs on one host, each binding its ranks to "the first cores",
land on the same ones. The cores a job may split are the ones it was started on where those are
narrower than the host (a cgroup cpuset, taskset: the job's own). Where a rank sees the whole host,
``auto`` leaves the cores other processes are bound to (another job's ranks) to them, and turns
binding off with one line where too few remain, or where Slurm gave the job part of the node
without binding it (choose_cores).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..comm import dist
from ..comm import launcher_env as launcher

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


def online_cpus(sysfs: Path | None = None) -> set[int]:
    """Every CPU of the host that is online (``/sys/devices/system/cpu/online``, e.g. ``0-63``)."""
    try:
        text = ((sysfs or CPU_SYSFS) / "online").read_text().strip()
    except OSError:
        return set(range(os.cpu_count() or 1))
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def bound_processes(ours: set[int], online: set[int], proc: Path = Path("/proc")) -> dict[int, set[int]]:
    """Processes of this host, other than ``ours``, bound to part of its CPUs (pid -> their CPUs):
    another job's ranks and loader workers, a ``taskset``. Kernel threads, bound to one CPU each by
    nature, have an empty command line and are left out; so are processes one cannot see."""
    found: dict[int, set[int]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) in ours:
            continue
        try:
            if not (entry / "cmdline").read_bytes():
                continue
            cores = os.sched_getaffinity(int(entry.name))
        except OSError:  # gone meanwhile, or hidden (hidepid)
            continue
        if cores and set(cores) < online:
            found[int(entry.name)] = set(cores)
    return found


def cpu_ranges(cpus: set[int] | list[int]) -> str:
    """``0-3,8`` for {0, 1, 2, 3, 8}."""
    ordered, parts = sorted(cpus), []
    for cpu in ordered:
        if parts and cpu == parts[-1][1] + 1:
            parts[-1][1] = cpu
        else:
            parts.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in parts)


def slurm_cpus_on_node(env=None) -> int | None:
    """The CPUs Slurm gave this job on this node (SLURM_CPUS_ON_NODE), None outside Slurm."""
    value = (os.environ if env is None else env).get("SLURM_CPUS_ON_NODE", "")
    return int(value) if value.isdigit() else None


def choose_cores(mode: str, started_on: list[int], online: set[int], others: dict[int, set[int]],
                 slurm_cpus: int | None, local_size: int) -> tuple[list[int] | None, str]:
    """The cores a host's ranks split among themselves, or None; and, when binding is off because
    another job may share the cores, the one line that says so (else "").

    Cores narrower than the host (a cgroup cpuset, Slurm's or mpirun's binding, taskset) are the
    job's own: the ranks split them. Where the rank sees the whole host, nothing says which cores are
    this job's: under Slurm with part of the node and no binding, another job may be given the rest
    (binding off); elsewhere the cores that other processes are bound to (another job's ranks) are
    left to them, and binding is off when too few remain. ``rank`` binds whatever these say.
    """
    if len(started_on) < local_size:
        return None, ""  # fewer cores than ranks: no block for every rank
    if set(started_on) != online:
        return started_on, ""
    if mode == "auto" and local_size == 1:
        # One rank on the host: nothing to keep apart. Bound to a block narrower than the host (its
        # threads), its Horovod, MPI and statistics threads would take turns with its compute on
        # those cores while the others idle (1-rank hvdtrain bench, 1 thread on 2 cores: unbound
        # ran at 1.10x bound, paired median of 6 rounds; docs/performance.md).
        return None, ""
    claimed = set().union(*others.values()) if others else set()
    free = [cpu for cpu in started_on if cpu not in claimed]
    if mode == "rank":
        return (free if len(free) >= local_size else started_on), ""
    force = "runtime.cpu_affinity=rank binds anyway"
    if slurm_cpus is not None and slurm_cpus < len(online):
        return None, (f"CPU binding off: Slurm gave this job {slurm_cpus} of the host's {len(online)} CPUs but "
                      f"did not bind it to them, so another job may be given the others and no core is known "
                      f"to be this job's (have Slurm bind: TaskPlugin=task/affinity or task/cgroup, srun "
                      f"--cpu-bind=cores; {force})")
    if len(free) < local_size:
        pid = min(others)
        return None, (f"CPU binding off: other processes on this host are bound to CPUs {cpu_ranges(claimed)} "
                      f"(e.g. pid {pid}, another job's rank), leaving {len(free)} for this job's {local_size} "
                      f"ranks here: binding too would put two jobs on the same cores ({force})")
    return free, ""


@dataclass
class Placement:
    """Where a rank's threads run: ``cores``, its own block (bound here), or None; and whether the
    launcher gave each rank of the host its own set of cores (srun --cpu-bind, mpirun -bind-to),
    None where that was not looked at (no binding asked for)."""

    cores: list[int] | None = None
    launcher_bound: bool | None = None


def place_rank(mode: str, device_type: str, elastic: bool) -> list[int] | None:
    """``place(...).cores``: this rank's own cores, bound, or None."""
    return place(mode, device_type, elastic).cores


def place(mode: str, device_type: str, elastic: bool) -> Placement:
    """Binds this rank's threads to its block of the cores its host's ranks may take (choose_cores)
    and returns it, or None where the threads stay where the launcher put them. Collectives (every
    rank calls them) unless off; rank 0 prints why binding is off where another job may share the
    cores."""
    if mode == "none" or (mode == "auto" and (device_type != "cpu" or elastic)):
        return Placement()
    if not hasattr(os, "sched_setaffinity"):
        return Placement()
    started_on = sorted(os.sched_getaffinity(0))
    host = launcher.host_name()
    everyone = dist.allgather_object((host, os.getpid(), started_on), name="hvdtrain.cpu_affinity")
    here = [(pid, cores) for other, pid, cores in everyone if other == host]
    launcher_bound = any(cores != started_on for _, cores in here)
    if launcher_bound:
        cores, reason = None, ""  # the launcher bound the ranks already
    else:
        online = online_cpus()
        others = bound_processes({pid for pid, _ in here}, online) if set(started_on) == online else {}
        cores, reason = choose_cores(mode, started_on, online, others, slurm_cpus_on_node(), dist.local_size())
    # One choice per host, its first rank's: the ranks looked at the host at slightly different times.
    verdicts = dist.allgather_object((host, cores, reason), name="hvdtrain.cpu_affinity_choice")
    cores = next(choice for other, choice, _ in verdicts if other == host)
    said = next(((other, why) for other, _, why in verdicts if why), None)
    if said is not None:
        dist.log(f"hvdtrain: {said[0]}: {said[1]}")
    if cores is None:
        return Placement(None, launcher_bound)
    mine = sorted(split_cores(topology_order(cores), dist.local_rank(), dist.local_size()))
    bind_threads(mine)
    return Placement(mine, launcher_bound)
