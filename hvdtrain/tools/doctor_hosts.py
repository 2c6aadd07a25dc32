"""The hosts ``hvdtrain doctor`` checks: -H, --hostfile, an elastic job's discovery script, or,
inside a Slurm allocation (``salloc``, ``sbatch``, ``srun ... hvdtrain doctor``) without either,
the allocation's nodes, which the doctor then reaches with ``srun`` instead of ssh (a cluster may
close ssh to compute nodes; a step of one's own job is always allowed). Also the network
interfaces the hosts share, and the one whose subnet connects them.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .process import run_with_deadline


class DoctorError(Exception):
    """A problem with the doctor's own arguments (bad host list, unreadable hostfile)."""


@dataclass
class Host:
    name: str
    slots: int
    facts: dict[str, Any] = field(default_factory=dict)
    problem: str = ""
    address: str | None = None  # the name resolved here, as ssh and the launchers resolve it


def check_host_name(name: str, where: str) -> str:
    """``name``, unless ssh or mpirun would read it as an option (``-oProxyCommand=...`` runs a
    command), or a shell would read part of it: horovodrun runs ``ssh <host> ...`` through a shell."""
    if name.startswith("-"):
        raise DoctorError(f"{where}: host name '{name}' starts with '-', which ssh and mpirun would read as an "
                          "option: remove it or correct the name")
    odd = sorted(set(re.sub(r"[A-Za-z0-9._@-]", "", name)))
    if odd:
        raise DoctorError(f"{where}: host name '{name}' holds {' '.join(repr(c) for c in odd)}, which no host name "
                          "has (letters, digits, '.', '-', '_', user@host): correct the name")
    return name


def parse_hosts(spec: str) -> list[Host]:
    """``node0:2,node1:2`` (slots default to 1) -> hosts, as horovodrun's -H reads it."""
    hosts = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, slots = item.partition(":")
        if not name or (slots and not slots.isdigit()) or slots == "0":
            raise DoctorError(f"bad host '{item}' in -H: expected host or host:slots, e.g. node0:8,node1:8")
        hosts.append(Host(check_host_name(name, "-H"), int(slots or 1)))
    if not hosts:
        raise DoctorError("no hosts given: use -H node0:1,node1:1 or --hostfile FILE")
    return hosts


def read_hostfile(path: Path) -> list[Host]:
    """Lines ``host slots=N`` (horovodrun and Open MPI's format); ``#`` starts a comment."""
    try:
        text = path.read_text()
    except OSError as error:
        raise DoctorError(f"cannot read hostfile {path}: {error.strerror}") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\d+))?(?:\s+max_slots\s*=\s*\d+)?", line)
        if not match or match.group(2) == "0":
            raise DoctorError(f"{path}:{number}: expected 'host slots=N', got '{line}'")
        hosts.append(Host(check_host_name(match.group(1), f"{path}:{number}"), int(match.group(2) or 1)))
    if not hosts:
        raise DoctorError(f"hostfile {path} lists no hosts")
    return hosts


def pick_hosts(args: argparse.Namespace) -> list[Host]:
    """-H, --hostfile, the discovery script's hosts, the Slurm allocation's, or localhost:2."""
    args.slurm = False
    if args.hostfile:
        return read_hostfile(args.hostfile)
    if args.hosts:
        return parse_hosts(args.hosts)
    if args.host_discovery_script:
        found = run_with_deadline([args.host_discovery_script], 60)
        if found.timed_out or found.returncode != 0:
            raise DoctorError(f"the discovery script {args.host_discovery_script} "
                              + ("gave no answer in 60 s" if found.timed_out else f"exited {found.returncode}"))
        return parse_hosts(",".join(found.stdout.split()))
    allocation = slurm_hosts(os.environ)
    if allocation:
        args.slurm = True
        print(f"hvdtrain doctor: in Slurm job {os.environ['SLURM_JOB_ID']}: its {len(allocation)} node(s), "
              f"probed with srun", flush=True)
        return [Host(check_host_name(name, "SLURM_JOB_NODELIST"), slots) for name, slots in allocation]
    return parse_hosts("localhost:2")


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``SLURM_TASKS_PER_NODE`` (``2(x3),1``) -> ``[2, 2, 2, 1]``."""
    counts = []
    for item in filter(None, spec.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            return []
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def slurm_hosts(env: Mapping[str, str], timeout: float = 30) -> list[tuple[str, int]] | None:
    """The allocation's nodes and tasks per node when the doctor runs inside one (``salloc``,
    ``sbatch``, ``srun``), else None. The node list is expanded by ``scontrol show hostnames``."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        return None
    try:
        found = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                               timeout=timeout, env=dict(env))
        names = found.stdout.split() if found.returncode == 0 else []
    except (OSError, subprocess.SubprocessError):
        names = []
    if not names:
        names = [nodelist] if re.fullmatch(r"[A-Za-z0-9._-]+", nodelist) else []
    if not names:
        return None
    slots = tasks_per_node(env.get("SLURM_TASKS_PER_NODE", "")) or [int(env.get("SLURM_NTASKS_PER_NODE", "1") or 1)]
    slots += [slots[-1]] * (len(names) - len(slots))
    return list(zip(names, slots))


def srun_probe_command(host: str, probe: list[str]) -> list[str]:
    """``probe`` (a command) run on ``host`` as a one-task step of this allocation. ``--overlap``
    lets it share the CPUs of a running step (the doctor's own, under ``srun ... hvdtrain doctor``)."""
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={host}", "--kill-on-bad-exit=0", *probe]


def extra_task(env: Mapping[str, str]) -> bool:
    """Whether this process is one of several tasks of an ``srun ... hvdtrain doctor`` step and not
    the first: one doctor per step is enough (it reaches every node with srun itself)."""
    return bool(env.get("SLURM_STEP_ID")) and int(env.get("SLURM_PROCID", "0") or 0) > 0


def common_interfaces(hosts: list[Host]) -> list[str]:
    names = [set(h.facts.get("interfaces", {})) for h in hosts if h.facts]
    return sorted(set.intersection(*names)) if names else []


def subnets(host: Host, interface: str) -> list[ipaddress.IPv4Interface]:
    return [ipaddress.ip_interface(a) for a in host.facts.get("interfaces", {}).get(interface, [])]


def connects(hosts: list[Host], interface: str) -> bool:
    """True when, on every host, a subnet of ``interface`` holds the addresses of all the others."""
    for host in hosts:
        others = [ipaddress.ip_address(h.address) for h in hosts if h is not host]
        if not any(all(address in net.network for address in others) for net in subnets(host, interface)):
            return False
    return True


def pick_interface(hosts: list[Host]) -> tuple[str | None, list[str]]:
    """(the interface that connects the hosts or None, the shared ones a launch could spread over).

    A launch left to itself may use every interface the hosts share: horovodrun gives them all to
    Open MPI (btl_tcp_if_include) and NCCL, and Open MPI's TCP transport then splits large
    messages over them and can hang (docs/launching.md). The loopback interface counts only where
    the hosts' names resolve to loopback addresses (several "hosts" on one machine).
    """
    if len(hosts) < 2 or any(not h.address or not h.facts for h in hosts):
        return None, []
    shared = common_interfaces(hosts)
    routed = [name for name in shared if connects(hosts, name)]
    loopback = {name for name in shared if all(net.ip.is_loopback for h in hosts for net in subnets(h, name))}
    choices = [name for name in shared if name not in loopback or name in routed]
    return (routed[0] if len(routed) == 1 else None), choices


def interface_line(chosen: str | None, choices: list[str]) -> str | None:
    """What to print about interfaces: nothing where only one could carry the traffic."""
    if len(choices) < 2:
        return None
    if chosen:
        return (f"to pin the network: horovodrun --network-interfaces {chosen} ... and "
                f"NCCL_SOCKET_IFNAME={chosen} (the hosts share {', '.join(choices)}; "
                f"only {chosen}'s subnet holds their addresses)")
    return (f"the hosts share {', '.join(choices)}: pin the one that connects them, horovodrun "
            "--network-interfaces IFACE ... and NCCL_SOCKET_IFNAME=IFACE")
