"""The plan of a Ray job before anything starts: ``hvdtrain ray``'s arguments, where each rank goes
(Horovod's own host assignment over the placement group's bundles), and the environment each rank
starts with. Pure functions and data, tested without Ray (tests/unit/test_ray_launch.py); the job
that carries the plan out is launch/ray.py.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import os
import signal
import socket
from dataclasses import dataclass

from .. import outcome

INSTALL_HINT = "Ray is not installed: pip install -e .[ray] (or make setup EXTRAS=ray)"
EXIT_PREEMPTED = outcome.EXIT_PREEMPTED  # the one map (outcome.py; light: no torch on the driver)
POLL_SECONDS = 0.5
# An actor that has not answered a poll for this long is taken as lost (its node died or hangs);
# Ray itself reports a dead actor sooner, when its worker process or raylet is gone.
ANSWER_SECONDS = 45.0
# Once one rank has finished or stopped for preemption, how long the others may take to follow.
FOLLOW_SECONDS = 120.0
TAIL_LINES = 30


class RayLaunchError(Exception):
    """A problem this command reports in one line (bad arguments, a cluster that cannot host the job)."""


# --- arguments -------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdtrain ray", usage="python -m hvdtrain ray -np N [options] -- [--config FILE] [key=value ...]",
        description="Run one training job on a Ray cluster: one Ray actor per rank in a placement group, "
        "Horovod's Gloo controller between them. Arguments after '--' are the train command's.",
        epilog="Details, the cluster-launcher config and KubeRay: docs/ray.md.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("--address", default="auto", help="Ray cluster to join (ray.init address; default: auto, "
                   "the cluster this node belongs to or RAY_ADDRESS)")
    p.add_argument("--cpus-per-rank", type=float, default=1, help="CPUs each rank reserves (default 1)")
    p.add_argument("--gpus-per-rank", type=float, default=0, help="GPUs each rank reserves (default 0)")
    p.add_argument("--resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom Ray resource each rank reserves as well (repeatable)")
    p.add_argument("--strategy", choices=("pack", "spread"), default="pack",
                   help="placement: pack ranks onto as few nodes as possible (default), or spread them")
    p.add_argument("--placement-timeout", type=float, default=300, metavar="S",
                   help="seconds to wait for the cluster to grant every rank's bundle (default 300)")
    p.add_argument("--rendezvous-port", type=int, default=0, metavar="PORT",
                   help="port of Horovod's rendezvous server on this machine (default: any free port)")
    p.add_argument("--rendezvous-addr", default="", metavar="IP", help="address the ranks reach this "
                   "machine at (default: this driver's Ray node IP)")
    p.add_argument("--chdir", default="", metavar="DIR", help="working directory of the ranks (default: this "
                   "command's directory where it exists on the rank's node, else the Ray worker's own)")
    p.add_argument("--script", default="", metavar="FILE", help="run 'python FILE ARGS' on every rank instead "
                   "of 'python -m hvdtrain train ARGS' (a wrapper of your own)")
    return p


@dataclass
class Options:
    np: int
    address: str
    bundle: dict[str, float]
    strategy: str
    placement_timeout: float
    rendezvous_port: int
    rendezvous_addr: str
    chdir: str
    program: list[str]


def parse_args(argv: list[str]) -> Options:
    """This command's options before '--', the rank's arguments after it."""
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser().parse_args(own)
    if args.np < 1:
        raise RayLaunchError(f"-np {args.np}: the number of ranks must be at least 1")
    if args.cpus_per_rank < 0 or args.gpus_per_rank < 0:
        raise RayLaunchError("--cpus-per-rank and --gpus-per-rank cannot be negative")
    bundle = {"CPU": args.cpus_per_rank}
    if args.gpus_per_rank:
        bundle["GPU"] = args.gpus_per_rank
    for item in args.resource:
        name, _, amount = item.partition("=")
        try:
            bundle[name] = float(amount)
        except ValueError:
            raise RayLaunchError(f"--resource {item}: expected NAME=AMOUNT, e.g. --resource hvd_slot=1") from None
    if not args.script and not rest:
        raise RayLaunchError("nothing to train: add the train arguments after '--', e.g. "
                             "python -m hvdtrain ray -np 2 -- --config demo")
    program = [args.script, *rest] if args.script else ["-m", "hvdtrain", "train", *rest]
    return Options(args.np, args.address, bundle, args.strategy, args.placement_timeout, args.rendezvous_port,
                   args.rendezvous_addr, args.chdir or os.getcwd(), program)


def check_train_args(train_args: list[str]) -> None:
    """The train arguments as the ranks will read them, checked here first: a typo in a key is one
    line now, not a line per rank after the cluster has started every actor."""
    from ..train.preflight import check_train_args as check

    check(train_args, "hvdtrain ray -- ")


# --- rank assignment (pure: unit-tested without Ray) -------------------------------------------

@dataclass
class Placement:
    """Where one actor landed, as it reported itself."""
    node_id: str
    ip: str
    iface: str
    gpus: list[str]


@dataclass
class Slot:
    """One rank's place in the job, as horovodrun would give it; ``actor`` indexes the actors."""
    actor: int
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int
    host: str


def host_names(placements: list[Placement]) -> dict[str, str]:
    """A name per Ray node for HOROVOD_HOSTNAME and the rendezvous' local scopes: its IP, unique per
    node on a real cluster; several Ray nodes on one IP (test clusters) get the node id added."""
    ips: dict[str, set[str]] = collections.defaultdict(set)
    for place in placements:
        ips[place.ip].add(place.node_id)
    return {p.node_id: p.ip if len(ips[p.ip]) == 1 else f"{p.ip}-{p.node_id[:8]}" for p in placements}


def assign_ranks(placements: list[Placement]) -> list[Slot]:
    """Ranks for the actors: nodes in the order of their first bundle, ranks contiguous on a node,
    local and cross ranks from Horovod's own get_host_assignments (what horovodrun -H does)."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    names = host_names(placements)
    by_node: dict[str, list[int]] = {}
    for index, place in enumerate(placements):
        by_node.setdefault(place.node_id, []).append(index)
    hosts = [HostInfo(names[node], len(actors)) for node, actors in by_node.items()]
    plan = get_host_assignments(hosts, len(placements))
    actors = [index for indices in by_node.values() for index in indices]  # in rank order
    return [Slot(actor, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size, s.hostname)
            for actor, s in zip(actors, plan)]


def rank_env(slot: Slot, iface: str, rendezvous_addr: str, rendezvous_port: int,
             node_gpus: list[str]) -> dict[str, str]:
    """The environment gloo_run gives a rank (create_slot_env_vars + create_run_env_vars)."""
    env = {
        "HOROVOD_HOSTNAME": slot.host, "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "PYTHONUNBUFFERED": "1",
    }
    if iface:
        env["HOROVOD_GLOO_IFACE"] = env["NCCL_SOCKET_IFNAME"] = iface
    if node_gpus:  # Ray gave each actor only its own GPUs; a rank uses device local_rank of its node's
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
    return env


def node_gpus(slots: list[Slot], placements: list[Placement]) -> dict[str, list[str]]:
    """Per host name, the GPUs of its ranks in local-rank order."""
    gpus: dict[str, list[str]] = collections.defaultdict(list)
    for slot in sorted(slots, key=lambda s: s.rank):
        gpus[slot.host].extend(placements[slot.actor].gpus)
    return gpus


def interface_of(ip: str) -> str:
    """The network interface that holds ``ip`` on this machine ('' when none is found: Gloo picks)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.family == socket.AF_INET and address.address == ip for address in addresses):
            return name
    if ipaddress.ip_address(ip).is_loopback:  # 127.x addresses answer on lo without being listed
        return next((name for name, addresses in psutil.net_if_addrs().items()
                     if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses)), "")
    return ""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


# --- the actor ---------------------------------------------------------------------------------
