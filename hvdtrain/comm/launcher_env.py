"""This process's place in the job as the launcher set it, before the engine is initialized.

Light on purpose (no torch, no Horovod): the CLI reads it to print a usage error or a config on
one rank only, and ``dist`` falls back to it until ``init()``.
"""

from __future__ import annotations

import ipaddress
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


def spans_hosts() -> bool:
    """Whether this job's ranks run on more than one host, as the launcher says; the one answer for
    every check that matters only across hosts (a host name or MASTER_ADDR on loopback).

    The launcher that started the ranks decides: horovodrun's cross size, else the first of
    horovodrun's, torchrun's and mpirun's world and local sizes that are both set. Only where none
    is set does the Slurm allocation's node count answer (either of its two variables over 1): an
    allocation of several nodes may run a job on one of them (torchrun on the first node alone). A
    value that is not a number says nothing, and the next source is asked."""
    env = os.environ

    def number(name: str) -> int | None:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            return None

    cross = number("HOROVOD_CROSS_SIZE")
    if cross is not None:
        return cross > 1
    for total, local in (("HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE"), ("WORLD_SIZE", "LOCAL_WORLD_SIZE"),
                         ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        world, here = number(total), number(local)
        if world is not None and here is not None:
            return world > here
    return any((number(name) or 0) > 1 for name in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))


def loopback_name_problem(iface_variable: str = "", fix: str = "") -> str | None:
    """One line when Gloo would give the other hosts a loopback address, else None.

    Gloo binds to the address this host's own name resolves to and tells the other ranks to connect
    there. Debian's default /etc/hosts maps the name to 127.0.1.1: every other host then connects
    to its own loopback ("Connection refused", a C++ IoException). Only a job across hosts is hurt.
    torch's Gloo binds to the interface GLOO_SOCKET_IFNAME names instead (``iface_variable``; its
    ``fix``, with ``{iface}`` for one of this host's interfaces); Horovod's Gloo, measured across two
    network namespaces, connects to 127.0.1.1 even with HOROVOD_GLOO_IFACE set, so only the name's
    mapping helps there.
    """
    if (iface_variable and os.environ.get(iface_variable)) or not spans_hosts():
        return None
    meeting = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") or os.environ.get("MASTER_ADDR")
    if meeting:  # hvdtrain ray's is IP:PORT/TOKEN
        meeting = meeting.split("/", 1)[0]
        meeting = meeting.rsplit(":", 1)[0] if meeting.count(":") == 1 else meeting
    # hvdtrain ray names each node by its IP: a loopback IP there is a node on this machine. A name
    # (horovodrun's -H node1) is never taken as one: its resolving to loopback is what is checked.
    node = os.environ.get("HOROVOD_HOSTNAME", "")
    if (meeting and _loopback(meeting)) or _loopback_ip(node):
        return None  # the ranks meet on loopback: every "host" is this machine, loopback reaches them
    address = name_loopback_address()
    return loopback_line(socket.gethostname(), address, fix) if address else None


def _loopback_ip(text: str) -> bool:
    """Whether ``text`` is a loopback IP address itself (a name is never resolved here)."""
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        return False


def _loopback(name: str) -> bool:
    try:
        return ipaddress.ip_address(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0]).is_loopback
    except (OSError, UnicodeError, IndexError, ValueError):
        return False


def name_loopback_address() -> str | None:
    """The loopback address this host's own name resolves to first (what Gloo would bind), or None."""
    try:
        address = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError, IndexError):
        return None  # hostname_problem says so
    return address if ipaddress.ip_address(address.split("%")[0]).is_loopback else None


def loopback_line(name: str, address: str, fix: str) -> str:
    return (f"this host's name '{name}' resolves to the loopback address {address} (/etc/hosts), so Gloo "
            f"would give the other hosts an address they cannot reach and the job would fail with 'Connection "
            f"refused': map '{name}' to this host's network address in /etc/hosts (in place of a line like "
            f"Debian's '127.0.1.1 {name}')" + (f", or {fix.format(iface=_iface())}" if fix else ""))


def _iface() -> str:
    """This host's first interface other than loopback (for the example in a fix), else eth0."""
    try:
        names = [name for _, name in socket.if_nameindex() if name != "lo"]
    except OSError:
        names = []
    return names[0] if names else "eth0"
