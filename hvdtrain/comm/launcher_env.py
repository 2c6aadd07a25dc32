"""This process's place in the job as the launcher set it, before the engine is initialized.

Light on purpose (no torch, no Horovod): the CLI reads it to print a usage error or a config on
one rank only, and ``dist`` falls back to it until ``init()``.
"""

from __future__ import annotations

import os
import socket

# The variables launchers set, first match wins: horovodrun, torchrun (dist.engine=torch; before
# the per-host launchers, since torchrun may itself run one per host under mpirun or srun), Open
# MPI's mpirun, PMIx (srun --mpi=pmix), MPICH/PMI, Slurm.
RANK_VARIABLES = ("HOROVOD_RANK", "RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
SIZE_VARIABLES = ("HOROVOD_SIZE", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARIABLES = ("HOROVOD_LOCAL_RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                        "SLURM_LOCALID")


def _first(names: tuple[str, ...], default: int) -> int:
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return default


def rank() -> int:
    return _first(RANK_VARIABLES, 0)


def size() -> int:
    return _first(SIZE_VARIABLES, 1)


def local_rank() -> int:
    return _first(LOCAL_RANK_VARIABLES, 0)


def torchrun_problem(engine: str) -> str | None:
    """One line when torchrun started this process for more than one rank but ``engine`` is not the
    torch engine: Horovod would start each rank as a job of its own (all of them rank 0, writing the
    same folder), since torchrun sets none of the variables Horovod reads."""
    started_by_torchrun = "TORCHELASTIC_RUN_ID" in os.environ and "HOROVOD_RANK" not in os.environ
    if engine != "torch" and started_by_torchrun and _first(("WORLD_SIZE",), 1) > 1:
        return (f"torchrun started this job ({os.environ['WORLD_SIZE']} ranks) but dist.engine={engine}: add "
                "dist.engine=torch, or launch with horovodrun (or mpirun, srun) for the Horovod engine")
    return None


def host_name() -> str:
    """This rank's host as the launcher named it (horovodrun's -H name), else the machine's name."""
    return os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname()


def hostname_problem() -> str | None:
    """None when this host's own name resolves, else one line saying what breaks and how to fix it.

    Horovod's Gloo controller looks up the host's name while it initializes; where the name does
    not resolve, the rank dies with a segmentation fault (exit 139) and no message. MPI does not
    need it, so the same hosts can look healthy under mpirun.
    """
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except (OSError, UnicodeError):
        return (f"this host's name '{name}' does not resolve (Horovod's Gloo controller would crash with a "
                f"segfault): add '127.0.1.1 {name}' to /etc/hosts or fix DNS")
    return None


NO_HOROVOD = ("dist.engine=horovod (the default) needs Horovod, which this Python does not have: set dist.engine=torch "
              "and launch with torchrun, or install Horovod with make setup (docs/launching.md#two-engines)")


def horovod_missing() -> bool:
    """Whether this Python has no ``horovod`` to import (an install for the torch engine alone)."""
    import importlib.util

    try:
        return importlib.util.find_spec("horovod") is None
    except (ImportError, ValueError):
        return True
