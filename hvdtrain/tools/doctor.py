"""``hvdtrain doctor``: is this set of hosts ready for a multi-node run, and how fast is allreduce?

    python -m hvdtrain doctor -H node0:1,node1:1
    python -m hvdtrain doctor --hostfile hostfiles/two-nodes.example --network-interfaces eth0

1. Every host answers over ssh (hosts that are this machine run locally, as with horovodrun) and
   reports its Python, torch, Horovod and hvdtrain versions, GPUs, Horovod's build (NCCL, Gloo,
   MPI), its network interfaces and whether its own host name resolves. Different versions or
   builds, an unreachable host or a name that does not resolve end the doctor with exit status 1
   and one line per problem naming the host. Where the hosts share several interfaces, the one
   whose subnet holds the other hosts' addresses is named, with the line that pins it.
2. One rank per slot is launched with horovodrun, once per controller Horovod was built with
   (Gloo, MPI); each job times allreduce (sum, float32) over a sweep of sizes on CPU tensors, and
   one of them (the first that succeeds) on GPU tensors too where every host has a GPU and NCCL
   ops: Horovod sends GPU tensors through NCCL under either controller, so that column is
   "nccl/gpu". The table shows bus bandwidth as nccl-tests defines it: busbw = algbw x 2(n-1)/n,
   algbw = bytes / time, time = the slowest rank's mean time per allreduce; so busbw is
   comparable across rank counts and approaches the link bandwidth for ring allreduce.
   Each launch has a deadline (--bench-timeout, 90 s); a launch still running then is ended with
   everything it started, and one line says how far it got and what to try.

Internal modes (run by the doctor itself on each host): ``--probe`` prints the host's facts as
one JSON line; ``--bench`` runs the timing loop under a launcher and rank 0 prints the results.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import re
import shlex
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .allreduce import bench, print_bandwidth, run_bench
from .process import run_with_deadline

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"
# Seconds a host may take to answer the probe once ssh has connected (it imports torch and Horovod).
PROBE_SECONDS = 90
# Facts that must agree on every host for Horovod to work (or to give the same results).
COMPARED = ("python", "torch", "horovod", "hvdtrain", "built")


class DoctorError(Exception):
    """A problem with the doctor's own arguments (bad host list, unreadable hostfile)."""


@dataclass
class Host:
    name: str
    slots: int
    facts: dict[str, Any] = field(default_factory=dict)
    problem: str = ""
    address: str | None = None  # the name resolved here, as ssh and the launchers resolve it


# --- arguments ---------------------------------------------------------------------------------
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


def parse_sizes(spec: str) -> list[int]:
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for item in spec.split(","):
        match = re.fullmatch(r"(\d+)([KMG]?)(?:i?B)?", item.strip(), re.IGNORECASE)
        if not match or int(match.group(1)) == 0:
            raise DoctorError(f"bad size '{item}' in --sizes: expected e.g. 4K,1M,64M")
        size = int(match.group(1)) * units[match.group(2).upper()]
        sizes.append(max(4, size // 4 * 4))  # whole float32 elements
    return sizes


# --- step 1: facts per host --------------------------------------------------------------------
def local_facts() -> dict[str, Any]:
    """What this host has, as one JSON-able dict (run on every host by ``--probe``)."""
    import psutil
    import torch

    import hvdtrain

    from .. import dist, launcher

    interfaces = {}  # name -> ["10.0.0.5/24", ...]: addresses with their subnets
    for name, addresses in psutil.net_if_addrs().items():
        ipv4 = [str(ipaddress.ip_interface(f"{a.address}/{a.netmask or 32}")) for a in addresses
                if a.family == socket.AF_INET]
        if ipv4:
            interfaces[name] = ipv4
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] \
        if torch.cuda.is_available() else []
    return {
        "hostname": socket.gethostname(), "executable": sys.executable,
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda or "",
        "horovod": dist.version(), "hvdtrain": hvdtrain.__version__,
        "hvdtrain_path": str(Path(hvdtrain.__file__).parent), "gpus": gpus, "built": dist.built(),
        "interfaces": interfaces, "hostname_problem": launcher.hostname_problem(),
        "gloo_hides_env": gloo_launcher_hides_env(),
    }


def gloo_launcher_hides_env() -> bool:
    """Whether this Horovod's ``horovodrun --gloo`` keeps the environment's values out of the
    ranks' command lines (third_party/horovod-0.28.1.patch). A stock Horovod 0.28.1 starts every
    rank as ``sh -c 'env K=V ... python ...'`` with the whole environment, API keys included."""
    try:
        from horovod.runner import gloo_run
    except ImportError:
        return True  # no horovodrun: nothing to expose
    return hasattr(gloo_run, "rank_env_vars")


def secrets_note(hosts: list[Host]) -> str | None:
    """One line naming the hosts whose horovodrun --gloo would show secrets to every user, or None."""
    exposed = [h.name for h in hosts if h.facts and not h.facts.get("gloo_hides_env", True)]
    if not exposed:
        return None
    return (f"note: {', '.join(exposed)}: this Horovod's horovodrun --gloo puts every environment value (API keys, "
            f"passwords) in the ranks' command lines, which any user of the host reads with ps: install Horovod "
            f"with hvdtrain's patch (make setup), or launch with mpirun -x NAME or srun (docs/launching.md)")


def is_local(name: str) -> bool:
    """True when ``name`` is this machine (horovodrun runs those ranks without ssh, and so do we)."""
    import psutil

    if name in ("localhost", socket.gethostname()):
        return True
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return False
    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    return address in local


def ssh_command(host: str, remote: str, port: int | None, identity: str | None, timeout: int) -> list[str]:
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}"]
    if port:
        cmd += ["-p", str(port)]
    if identity:
        cmd += ["-i", identity]
    return cmd + ["--", host, remote]  # '--': the host is never an option, whatever its name


def probe_host(host: Host, args: argparse.Namespace) -> None:
    """Fill ``host.facts`` (or ``host.problem``) by running ``--probe`` there."""
    python = sys.executable
    forwarded = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    if is_local(host.name):
        cmd = [python, "-m", "hvdtrain", "doctor", "--probe"]
    else:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in forwarded.items())
        remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; {exports} {shlex.quote(python)} -m hvdtrain doctor --probe"
        cmd = ssh_command(host.name, remote, args.ssh_port, args.ssh_identity_file, args.connect_timeout)
    result = run_with_deadline(cmd, args.connect_timeout + PROBE_SECONDS)
    if result.timed_out:
        host.problem = f"no answer within {args.connect_timeout + PROBE_SECONDS}s (ssh or Python hangs)"
        return
    last_error = (result.stderr.strip().splitlines() or ["no output"])[-1]
    if result.returncode == 255:
        host.problem = f"not reachable over ssh ({last_error}); check that `ssh {host.name} true` works " \
                       "without a password or prompt"
    elif result.returncode == 127:
        host.problem = f"{python} not found there: every host needs the same Python environment at the same path"
    elif result.returncode != 0:
        host.problem = f"the probe failed there ({last_error}); run `{python} -m hvdtrain doctor --probe` on it"
    else:
        try:
            host.facts = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            host.problem = f"unexpected probe output: {result.stdout[-200:]!r}"


def compare_hosts(hosts: list[Host]) -> list[str]:
    """Problems that make the hosts unfit to train together, one line each, naming the host."""
    problems = [f"{h.name}: {h.problem}" for h in hosts if h.problem]
    problems += [f"{h.name}: {h.facts['hostname_problem']}" for h in hosts if h.facts.get("hostname_problem")]
    reachable = [h for h in hosts if not h.problem]
    if len(reachable) < 2:
        return problems
    reference = reachable[0]
    for host in reachable[1:]:
        for key in COMPARED:
            mine, theirs = host.facts.get(key), reference.facts.get(key)
            if mine != theirs:
                problems.append(f"{host.name}: {key} {format_fact(key, mine)} differs from "
                                f"{reference.name}'s {format_fact(key, theirs)} (environments must match)")
    if not common_interfaces(reachable):
        problems.append("no network interface name is common to all hosts: pass --network-interfaces "
                        "(horovodrun) and NCCL_SOCKET_IFNAME explicitly")
    return problems


def format_fact(key: str, value: Any) -> str:
    if key == "built" and isinstance(value, dict):
        return "+".join(name for name in ("nccl", "gloo", "mpi") if value.get(name)) or "nothing"
    return str(value)


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


def print_hosts(hosts: list[Host]) -> None:
    header = f"{'host':<16} {'slots':>5}  {'python':<8} {'torch':<14} {'horovod':<8} {'hvdtrain':<8} " \
             f"{'built':<14} gpus"
    print(header)
    for host in hosts:
        f = host.facts
        if not f:
            print(f"{host.name:<16} {host.slots:>5}  unreachable or failed: see below")
            continue
        gpus = f"{len(f['gpus'])} x {f['gpus'][0]}" if f["gpus"] else "none"
        print(f"{host.name:<16} {host.slots:>5}  {f['python']:<8} {f['torch']:<14} {f['horovod']:<8} "
              f"{f['hvdtrain']:<8} {format_fact('built', f['built']):<14} {gpus}")


# --- command line ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdtrain doctor",
        description="Check that hosts can train together (ssh, versions, Horovod build, interfaces) and "
                    "measure allreduce bandwidth with one rank per slot.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="host:slots,... as for horovodrun (default: localhost:2)")
    where.add_argument("--hostfile", type=Path, help="file of 'host slots=N' lines")
    p.add_argument("-p", "--ssh-port", type=int, help="ssh port on all hosts (default: ssh's own configuration)")
    p.add_argument("-i", "--ssh-identity-file", help="ssh private key")
    p.add_argument("--network-interfaces", help="interfaces for horovodrun, e.g. eth0 or ib0 "
                   "(default: horovodrun finds the common routed ones)")
    p.add_argument("--controllers", default="auto", help="gloo,mpi or a subset (default: those Horovod was built with)")
    p.add_argument("--sizes", default=DEFAULT_SIZES, help=f"allreduce sizes in bytes (default: {DEFAULT_SIZES})")
    p.add_argument("--iters", type=int, default=0, help="timed allreduces per size (default: 3-50 by size)")
    p.add_argument("--warmup", type=int, default=2, help="untimed allreduces per size first")
    p.add_argument("--skip-bench", action="store_true", help="only check the hosts")
    p.add_argument("--connect-timeout", type=int, default=10, help="ssh connect timeout in seconds")
    p.add_argument("--bench-timeout", type=int, default=90,
                   help="seconds allowed per bandwidth job; then it is ended with all it started (default: 90)")
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--bench", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--devices", default="cpu", help=argparse.SUPPRESS)  # for --bench: cpu or cpu,cuda
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.probe:
        print(json.dumps(local_facts()), flush=True)
        return 0
    sizes = parse_sizes(args.sizes)
    if args.bench:
        bench(sizes, args.iters, args.warmup, args.devices.split(","), args.bench_timeout)
        return 0
    hosts = read_hostfile(args.hostfile) if args.hostfile else parse_hosts(args.hosts or "localhost:2")
    if len({h.name for h in hosts}) != len(hosts):
        raise DoctorError("a host is listed twice: give each host once with its slot count")

    print(f"hvdtrain doctor: {len(hosts)} host(s), {sum(h.slots for h in hosts)} slot(s)", flush=True)
    for host in hosts:
        try:
            host.address = socket.gethostbyname(host.name)
        except OSError:
            pass  # the probe says why ssh cannot reach it
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        list(pool.map(lambda host: probe_host(host, args), hosts))
    print_hosts(hosts)
    reachable = [h for h in hosts if h.facts]
    if reachable:
        print(f"network interfaces on every host: {', '.join(common_interfaces(reachable)) or 'none'}")
    chosen, choices = pick_interface(hosts)
    line = None if args.network_interfaces else interface_line(chosen, choices)
    if line:
        print(line)
    problems = compare_hosts(hosts)
    for host in reachable:
        if host.facts["gpus"] and host.slots > len(host.facts["gpus"]):
            print(f"note: {host.name} has {host.slots} slots but {len(host.facts['gpus'])} GPU(s): ranks would share GPUs")
    note = secrets_note(hosts)
    if note:
        print(note)
    if problems:
        for problem in problems:
            print(f"hvdtrain doctor: {problem}", file=sys.stderr)
        return 1
    if args.skip_bench:
        print("hosts OK (bandwidth not measured: --skip-bench)")
        return 0

    built = reachable[0].facts["built"]
    wanted = ["gloo", "mpi"] if args.controllers == "auto" else [c.strip() for c in args.controllers.split(",")]
    unknown = [c for c in wanted if c not in ("gloo", "mpi")]
    if unknown:
        raise DoctorError(f"unknown controller '{unknown[0]}' in --controllers: choose gloo and/or mpi")
    controllers = [c for c in wanted if built.get(c)]
    if not controllers:
        print(f"hvdtrain doctor: Horovod has none of {', '.join(wanted)} built", file=sys.stderr)
        return 1
    # The measurements pin the interface that connects the hosts (unless told one): with
    # several, Open MPI's TCP transport can hang for good (docs/launching.md, "doctor").
    interface = args.network_interfaces or chosen
    if interface and not args.network_interfaces:
        print(f"(the measurements use --network-interfaces {interface})")
    # GPU tensors go through NCCL whichever controller runs: time them in one job only.
    gpus = all(h.facts["gpus"] for h in reachable) and built.get("nccl")
    results, failed = [], []
    for controller in controllers:
        devices = ["cpu", "cuda"] if gpus and not any("cuda" in r["seconds"] for r in results) else ["cpu"]
        print(f"measuring allreduce with the {controller} controller ...", flush=True)
        result, error = run_bench(controller, hosts, args, sizes, devices, interface, chosen, choices)
        if result:
            results.append(result)
        else:
            failed.append(error)
    if results:
        print_bandwidth(results)
    for problem in failed:
        print(f"hvdtrain doctor: {problem}", file=sys.stderr)
    return 1 if failed else 0
