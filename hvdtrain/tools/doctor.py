"""``hvdtrain doctor``: is this set of hosts ready for a multi-node run, and how fast is allreduce?

    python -m hvdtrain doctor -H node0:1,node1:1
    python -m hvdtrain doctor --hostfile hostfiles/two-nodes.example --network-interfaces eth0

1. Every host answers over ssh (hosts that are this machine run locally, as with horovodrun) and
   reports its Python, torch, Horovod and hvdtrain versions, GPUs, Horovod's build (NCCL, Gloo,
   MPI), its network interfaces and whether its own host name resolves. Different versions or
   builds, an unreachable host or a name that does not resolve end the doctor with exit status 1
   and one line per problem naming the host (doctor_probe.py). Where the hosts share several
   interfaces, the one whose subnet holds the other hosts' addresses is named, with the line that
   pins it (doctor_hosts.py).
2. One rank per slot is launched with horovodrun (inside a Slurm allocation: as an srun step of
   it, allreduce_slurm.py), once per controller Horovod was built with (Gloo, MPI); each job
   times allreduce (sum, float32) over a sweep of sizes on CPU tensors, and one of them (the
   first that succeeds) on GPU tensors too where every host has a GPU and NCCL ops: Horovod
   sends GPU tensors through NCCL under either controller, so that column is "nccl/gpu". The
   table shows bus bandwidth as nccl-tests defines it: busbw = algbw x 2(n-1)/n, algbw = bytes /
   time, time = the slowest rank's mean time per allreduce; so busbw is comparable across rank
   counts and approaches the link bandwidth for ring allreduce.
   Each launch has a deadline (--bench-timeout, 90 s); a launch still running then is ended with
   everything it started, and one line says how far it got and what to try.
3. The known traps, one line each with the fix (doctor_checks.py): GPU operations without a GPU
   driver, a package a host cannot import or has in another version, an elastic start on one host,
   and with ``--config``/``key=value``: data.dir missing on a host, output.dir not writable or
   short of space for the checkpoints, and each host's read speed of the data folder.

Inside a Slurm allocation (``salloc``, ``sbatch``, ``srun ... hvdtrain doctor``) without -H, the
hosts are the allocation's, the probe runs on each with srun instead of ssh, and so do the allreduce
ranks: one step of the allocation per controller (allreduce_slurm.py), nothing over ssh.

Internal modes (run by the doctor itself on each host): ``--probe`` prints the host's facts as
one JSON line; ``--bench`` runs the timing loop under a launcher and rank 0 prints the results.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import ConfigError
from ..job_config import load_config
from . import doctor_checks as checks
from .allreduce import bench, print_bandwidth, run_bench
from .allreduce_slurm import NotStarted, gloo_rank_env, launch_line, run_srun_bench

# The doctor's names, as tests and the CLI know them: the host list, the probe's facts and the
# traps live apart.
from .doctor_checks import gloo_launcher_hides_env, secrets_note  # noqa: F401
from .doctor_hosts import (  # noqa: F401 (re-exported)
    DoctorError,
    Host,
    check_host_name,
    common_interfaces,
    extra_task,
    interface_line,
    parse_hosts,
    pick_hosts,
    pick_interface,
    read_hostfile,
    srun_probe_command,
)
from .doctor_probe import (  # noqa: F401 (re-exported)
    COMPARED,
    PROBE_SECONDS,
    compare_hosts,
    format_fact,
    is_local,
    local_facts,
    print_hosts,
    probe_folders,
    probe_host,
    ssh_command,
)

DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M"


# --- arguments ---------------------------------------------------------------------------------
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


# --- command line ------------------------------------------------------------------------------
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdtrain doctor",
        description="Check that hosts can train together (ssh, versions, Horovod build, interfaces) and "
                    "measure allreduce bandwidth with one rank per slot.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", help="host:slots,... as for horovodrun (default: localhost:2)")
    where.add_argument("--hostfile", type=Path, help="file of 'host slots=N' lines")
    where.add_argument("--host-discovery-script", help="the elastic job's script (prints host:slots lines)")
    p.add_argument("--config", help="the run's config: check its data.dir, output.dir and checkpoint size too")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for training")
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
    p.add_argument("--data-dir", help=argparse.SUPPRESS)  # for --probe: the folders to check
    p.add_argument("--output-dir", help=argparse.SUPPRESS)
    return p


def trap_lines(hosts: list[Host], args: argparse.Namespace) -> list[str]:
    """The known traps (doctor_checks): the problems are returned, the other lines printed."""
    problems = checks.host_problems(hosts)
    elastic = bool(args.host_discovery_script) or bool(args.cfg and args.cfg.elastic.enabled)
    line = checks.elastic_problem(hosts, elastic, args.network_interfaces)
    problems += [line] if line else []
    if args.cfg is not None:
        try:
            estimate = checks.checkpoint_estimate(args.cfg)
        except Exception as error:  # an estimate is advice: a model that cannot be built says so at training
            estimate = None
            print(f"checkpoint size not estimated ({type(error).__name__}: {str(error)[:100]})")
        line, short = checks.disk_line(hosts, estimate, args.cfg.checkpoint.keep)
        if short:
            problems.append(line)
        elif line:
            print(line)
    for line in checks.read_speed_lines(hosts):
        print(line)
    return problems


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.probe:
        print(json.dumps(local_facts(args.data_dir, args.output_dir)), flush=True)
        return 0
    if args.bench:  # a rank (of horovodrun's, or of an srun step: every task of it measures)
        os.environ.update(gloo_rank_env(os.environ))  # its place in a Gloo step the doctor started with srun
        bench(parse_sizes(args.sizes), args.iters, args.warmup, args.devices.split(","), args.bench_timeout)
        return 0
    if extra_task(os.environ):
        return 0  # `srun -N4 hvdtrain doctor`: the first task checks every node, the others have nothing to add
    sizes = parse_sizes(args.sizes)
    hosts = pick_hosts(args)
    if len({h.name for h in hosts}) != len(hosts):
        raise DoctorError("a host is listed twice: give each host once with its slot count")
    try:
        args.cfg = load_config(args.config, args.overrides) if args.config or args.overrides else None
    except ConfigError as error:
        raise DoctorError(str(error)) from None

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
    problems = compare_hosts(hosts) + trap_lines(hosts, args)
    for host in reachable:
        if host.facts["gpus"] and host.slots > len(host.facts["gpus"]):
            print(f"note: {host.name} has {host.slots} slots but {len(host.facts['gpus'])} GPU(s): "
                  "ranks would share GPUs")
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
    gpus = bool(all(h.facts["gpus"] for h in reachable) and built.get("nccl"))
    results, failed = measure(controllers, hosts, args, sizes, gpus, interface, chosen, choices)
    if results:
        print_bandwidth(results)
        measured = [r["controller"] for r in results]
        print(launch_line(hosts, measured) if args.slurm else horovodrun_line(hosts))
    for problem in failed:
        print(f"hvdtrain doctor: {problem}", file=sys.stderr)
    return 1 if failed else 0


def measure(controllers: list[str], hosts: list[Host], args: argparse.Namespace, sizes: list[int], gpus: bool,
            interface: str | None, chosen: str | None, choices: list[str]) -> tuple[list[dict], list[str]]:
    """One launch per controller: horovodrun, or inside an allocation an srun step
    (allreduce_slurm.py); returns (results, one line per failed launch). A step srun could not
    start at all ends the loop: the next controller's would fail the same way."""
    launch = run_srun_bench if args.slurm else run_bench
    how = f" (an srun step of Slurm job {os.environ.get('SLURM_JOB_ID', '?')})" if args.slurm else ""
    results: list[dict] = []
    failed: list[str] = []
    for controller in controllers:
        devices = ["cpu", "cuda"] if gpus and not any("cuda" in r["seconds"] for r in results) else ["cpu"]
        print(f"measuring allreduce with the {controller} controller{how} ...", flush=True)
        result, error = launch(controller, hosts, args, sizes, devices, interface, chosen, choices)
        if result:
            results.append(result)
        else:
            failed.append(error)
            if isinstance(error, NotStarted):
                break
    return results, failed


def horovodrun_line(hosts: list[Host]) -> str:
    """How the allreduce ranks were started outside an allocation."""
    remote = [h.name for h in hosts if not is_local(h.name)]
    return ("allreduce ranks launched with horovodrun over ssh" if remote
            else "allreduce ranks launched with horovodrun on this machine (no ssh)")
