"""Step 2 of ``hvdtrain doctor`` inside a Slurm allocation: the allreduce ranks started by ``srun``.

Where the doctor's hosts are the allocation's nodes (``doctor_hosts.pick_hosts``), each
controller's measurement is one job step of the allocation, one task per slot, the way
``hostfiles/slurm/train.sbatch`` starts training ranks; nothing goes over ssh, which a cluster may
close between compute nodes:

- **mpi**: ``srun --mpi=pmix`` (``SRUN_MPI`` names another plugin, as for train.sbatch); PMIx gives
  Open MPI, and so Horovod, each rank's place.
- **gloo**: ``srun --mpi=none``; the doctor serves Horovod's Gloo rendezvous itself (the same
  server as ``hvdtrain ray``'s, behind a random token, on the address the ranks reach this machine
  at) and hands each rank the host plan; a rank takes its rank, local and cross rank from the plan,
  found by its node (``SLURMD_NODENAME``) and ``SLURM_LOCALID`` (``gloo_rank_env``), as horovodrun
  would have given them.

The step runs with ``--overlap`` (it shares the CPUs of a running step, e.g. the doctor's own under
``srun ... hvdtrain doctor``), one CPU per task, and ``--immediate``: a step that cannot be
created at once (more CPUs than the allocation has, other steps holding the nodes) ends with
srun's reason, and the doctor says so in one line (``NotStarted``) instead of waiting. The whole
launch still has the doctor's deadline (``process.run_with_deadline``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any, Mapping, Sequence

from .allreduce import RESULT_MARKER, STEP_MARKER, bench_arguments, reached, read_steps, stall_message
from .process import run_with_deadline

# The host plan of a Gloo launch, "node0:2,node1:2", for the ranks to find their place in.
SLOTS_VARIABLE = "HVDTRAIN_DOCTOR_SLOTS"
# Seconds srun may take to create the step before it gives up (--immediate).
STEP_START_SECONDS = 20
# Variables that describe the process the doctor runs in (a step of its own, a launcher's rank),
# not the ranks it starts: left out of the bench step's environment.
OUTER_PREFIXES = ("PMIX_", "PMI_", "OMPI_COMM_WORLD_")
OUTER_VARIABLES = ("SLURM_NTASKS_PER_NODE", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK",
                   "HOROVOD_LOCAL_SIZE", "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE", "HOROVOD_HOSTNAME",
                   "HOROVOD_GLOO_RENDEZVOUS_ADDR", "HOROVOD_GLOO_RENDEZVOUS_PORT", "HOROVOD_GLOO_IFACE",
                   "HOROVOD_CONTROLLER", "HOROVOD_CPU_OPERATIONS", SLOTS_VARIABLE)


class NotStarted(str):
    """The line for a step srun could not start: the next controller's step would fail the same way."""


def srun_mpi() -> str:
    """srun's MPI plugin for the MPI controller (train.sbatch's SRUN_MPI; default pmix)."""
    return os.environ.get("SRUN_MPI") or "pmix"


def job_id() -> str:
    return os.environ.get("SLURM_JOB_ID", "?")


def launch_line(hosts: Sequence[Any], controllers: Sequence[str]) -> str:
    """The one line that says how the measured ranks were started inside the allocation
    (``controllers``: those the ranks reported, in the table's order)."""
    how = {"gloo": "gloo: srun --mpi=none and the doctor's rendezvous", "mpi": f"mpi: srun --mpi={srun_mpi()}"}
    ranks = sum(h.slots for h in hosts)
    return (f"allreduce ranks launched with srun in Slurm job {job_id()}, {ranks} ranks on {len(hosts)} node(s) "
            f"({', '.join(how.get(c, c) for c in controllers)}); no ssh")


# --- the ranks' side ---------------------------------------------------------------------------
def gloo_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """The HOROVOD_* variables horovodrun would give this task, from the doctor's host plan
    (``SLOTS_VARIABLE``), this task's node and its local id; {} outside such a launch."""
    plan = env.get(SLOTS_VARIABLE)
    if not plan:
        return {}
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    hosts = [HostInfo.from_string(item) for item in plan.split(",")]
    node = env.get("SLURMD_NODENAME") or socket.gethostname()
    local = int(env.get("SLURM_LOCALID", "0") or 0)
    for slot in get_host_assignments(hosts, sum(h.slots for h in hosts)):
        if slot.hostname == node and slot.local_rank == local:
            return {"HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
                    "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
                    "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size)}
    raise SystemExit(f"hvdtrain doctor: srun placed task {local} of node {node} outside the doctor's plan {plan}")


# --- the doctor's side -------------------------------------------------------------------------
def local_addresses() -> set[str]:
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}


def rendezvous_address(hosts: Sequence[Any], interface: str | None) -> str:
    """The address of this machine that the ranks reach the doctor's rendezvous at: its address on
    ``interface``, else the one its route to the first other host leaves from, else loopback (every
    rank on this machine)."""
    import psutil

    if interface:
        for address in psutil.net_if_addrs().get(interface, []):
            if address.family == socket.AF_INET:
                return address.address
    mine = local_addresses()
    remote = [h.address for h in hosts if h.address and h.address not in mine and not h.address.startswith("127.")]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((remote[0], 9))  # UDP: no packet is sent, the kernel only picks the route
        return probe.getsockname()[0]


def gloo_interface(address: str, interface: str | None, choices: Sequence[str]) -> str:
    """HOROVOD_GLOO_IFACE: the interface named or picked, else the one that holds the rendezvous
    address when the hosts share it (loopback when every rank is on this machine), else none (Gloo
    then uses the host's name)."""
    if interface:
        return interface
    from ..launch.ray_plan import interface_of

    name = interface_of(address)
    return name if name and (address.startswith("127.") or name in choices) else ""


def start_rendezvous(hosts: Sequence[Any], address: str) -> tuple[Any, int]:
    """Horovod's Gloo rendezvous server for the plan of ``hosts``, on ``address`` only, behind a token."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    from ..launch.ray_rendezvous import Rendezvous

    server = Rendezvous()
    port = server.start_on(0, address)
    try:
        server.init(get_host_assignments([HostInfo(h.name, h.slots) for h in hosts], sum(h.slots for h in hosts)))
    except BaseException:
        server.stop()
        raise
    return server, port


def srun_bench_command(controller: str, hosts: Sequence[Any], args: argparse.Namespace,
                       devices: Sequence[str]) -> list[str]:
    """One step of the allocation: a task per slot, block-distributed over the hosts in order."""
    ranks = sum(h.slots for h in hosts)
    cmd = ["srun", "--overlap", f"--nodes={len(hosts)}", f"--ntasks={ranks}",
           f"--nodelist={','.join(h.name for h in hosts)}", "--distribution=block", "--cpus-per-task=1",
           f"--immediate={min(STEP_START_SECONDS, max(1, args.bench_timeout // 3))}", "--kill-on-bad-exit=1",
           f"--mpi={srun_mpi() if controller == 'mpi' else 'none'}"]
    if len({h.slots for h in hosts}) == 1:
        cmd.append(f"--ntasks-per-node={hosts[0].slots}")
    return cmd + [sys.executable, *bench_arguments(args, devices)]


def srun_env(controller: str, hosts: Sequence[Any], devices: Sequence[str], interface: str | None,
             rendezvous: tuple[str, int, str] | None, gloo_iface: str = "") -> dict[str, str]:
    """The step's environment (srun passes it to every task): the doctor's, less what describes
    the doctor's own place in a job, plus the controller's settings."""
    env = {k: v for k, v in os.environ.items() if k not in OUTER_VARIABLES and not k.startswith(OUTER_PREFIXES)}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    if controller == "gloo":
        address, port, token = rendezvous or ("127.0.0.1", 0, "")
        env.update({"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                    "HOROVOD_GLOO_RENDEZVOUS_ADDR": f"{address}:{port}/{token}",
                    "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
                    SLOTS_VARIABLE: ",".join(f"{h.name}:{h.slots}" for h in hosts)})
        if gloo_iface:
            env["HOROVOD_GLOO_IFACE"] = gloo_iface
            if "cuda" in devices:
                env.setdefault("NCCL_SOCKET_IFNAME", gloo_iface)
    else:
        env["HOROVOD_CONTROLLER"] = "mpi"
        if interface:  # what horovodrun --network-interfaces gives Open MPI and NCCL
            env.setdefault("OMPI_MCA_btl_tcp_if_include", interface)
            if "cuda" in devices:
                env.setdefault("NCCL_SOCKET_IFNAME", interface)
    return env


# What srun says when it could not create the step or start its tasks at all (as opposed to a task
# that started and failed: "task 0: Exited with exit code 1").
START_FAILURES = ("create step", "step creation", "unrecognized option", "invalid option", "plugin", "MPI type")


def srun_error(stderr: str) -> str:
    lines = [line.strip() for line in stderr.splitlines() if line.strip().startswith("srun:")]
    errors = [line for line in lines if "error" in line or "fatal" in line]
    return (errors or lines or ["no message"])[-1]


def start_failed(stderr: str) -> bool:
    return any(marker in line for line in stderr.splitlines() if line.strip().startswith("srun:")
               for marker in START_FAILURES)


def not_started(controller: str, hosts: Sequence[Any], stderr: str) -> str:
    """The one line for a step srun did not start, with what to do about it."""
    ranks = sum(h.slots for h in hosts)
    error = srun_error(stderr)
    if controller == "mpi" and ("mpi/" in error or "MPI" in error or "plugin" in error):
        return NotStarted(
            f"mpi controller: srun could not start the ranks with --mpi={srun_mpi()} ({error}): set SRUN_MPI to a "
            "plugin `srun --mpi=list` shows (pmix_v4, pmi2), or measure with --controllers gloo")
    return NotStarted(
        f"srun could not start the {ranks} allreduce ranks in Slurm job {job_id()} ({error}): the measurement "
        f"runs one task per slot ({', '.join(f'{h.name}:{h.slots}' for h in hosts)}) with a CPU each, inside the "
        f"allocation; ask for them (sbatch/salloc --ntasks={ranks} --nodes={len(hosts)}), or add --skip-bench "
        "(the host checks above stand)")


def run_srun_bench(controller: str, hosts: Sequence[Any], args: argparse.Namespace, sizes: Sequence[int],
                   devices: Sequence[str] = ("cpu",), interface: str | None = None, chosen: str | None = None,
                   choices: Sequence[str] = ()) -> tuple[dict | None, str]:
    """``allreduce.run_bench``'s counterpart inside an allocation: (results, "") or (None, one line);
    the line is a ``NotStarted`` when srun could not start the step at all."""
    server = None
    rendezvous = None
    gloo_iface = ""
    if controller == "gloo":
        address = rendezvous_address(hosts, interface)
        try:
            server, port = start_rendezvous(hosts, address)
        except OSError as error:
            return None, (f"gloo controller: cannot serve Horovod's rendezvous on {address} ({error.strerror}); "
                          "name the interface that connects the nodes with --network-interfaces, or --controllers mpi")
        rendezvous = (address, port, server.token)
        gloo_iface = gloo_interface(address, interface, choices)
    try:
        env = srun_env(controller, hosts, devices, interface, rendezvous, gloo_iface)
        finished = run_with_deadline(srun_bench_command(controller, hosts, args, devices), args.bench_timeout, env)
    finally:
        if server is not None:
            server.stop()
    results = []
    for line in finished.stdout.splitlines():
        if RESULT_MARKER in line:
            results.append(json.JSONDecoder().raw_decode(line.split(RESULT_MARKER, 1)[1])[0])
    ranks = sum(h.slots for h in hosts)
    if results and all(r["size"] == ranks for r in results):
        return results[0], ""
    if results:  # every task a world of its own: the step had no working MPI plugin
        return None, (f"{controller} controller: the {ranks} tasks srun started did not form one job (each saw "
                      f"{results[0]['size']} rank(s)): set SRUN_MPI to a plugin `srun --mpi=list` shows "
                      "(pmix, pmix_v4, pmi2)" + (", or --controllers gloo" if controller == "mpi" else ""))
    steps = read_steps(finished.stdout)
    if finished.timed_out:
        what = reached(hosts, steps, sizes, devices)
        if not steps:
            what = "no rank started (srun's step did not start, or the ranks could not start Python)"
        return None, stall_message(controller, args.bench_timeout, what, devices, interface, chosen, choices)
    if not steps and start_failed(finished.stderr):
        return None, not_started(controller, hosts, finished.stderr)
    output = [line for line in (finished.stderr.strip() or finished.stdout.strip()).splitlines()
              if STEP_MARKER not in line]
    return None, f"{controller} controller: srun exited {finished.returncode}: {' | '.join(output[-3:])}"
