"""The doctor's first step: every host's facts, probed over ssh (or as a step of a Slurm allocation,
or locally for this machine), compared, and printed as one table (tools/doctor.py runs it).

A host's facts (``local_facts``, printed as one JSON line by ``hvdtrain doctor --probe`` on that
host): Python, torch, Horovod and hvdtrain versions, GPUs, Horovod's build, network interfaces,
whether its own host name resolves or names a loopback address, and the run's folders
(doctor_checks.py). Hosts whose versions or builds differ, that cannot be reached or whose name
does not resolve give one problem line each, naming the host (``compare_hosts``).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import platform
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from . import doctor_checks as checks
from .allreduce_slurm import local_addresses
from .doctor_checks import gloo_launcher_hides_env
from .doctor_hosts import Host, common_interfaces, srun_probe_command
from .process import run_with_deadline

# Seconds a host may take to answer the probe once ssh has connected (it imports torch and Horovod).
PROBE_SECONDS = 90
# Facts that must agree on every host for Horovod to work (or to give the same results).
COMPARED = ("python", "torch", "horovod", "hvdtrain", "built")


def local_facts(data_dir: str | None = None, output_dir: str | None = None) -> dict[str, Any]:
    """What this host has, as one JSON-able dict (run on every host by ``--probe``)."""
    import psutil
    import torch

    import hvdtrain

    from ..comm import dist
    from ..comm import launcher_env as launcher

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
        "loopback_name": launcher.name_loopback_address() or "",
        "gloo_hides_env": gloo_launcher_hides_env(), **checks.probe_facts(data_dir, output_dir),
    }



def is_local(name: str) -> bool:
    """True when ``name`` is this machine (horovodrun runs those ranks without ssh, and so do we)."""
    if name in ("localhost", socket.gethostname()):
        return True
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return False
    return address in local_addresses()



def ssh_command(host: str, remote: str, port: int | None, identity: str | None, timeout: int) -> list[str]:
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}"]
    if port:
        cmd += ["-p", str(port)]
    if identity:
        cmd += ["-i", identity]
    return cmd + ["--", host, remote]  # '--': the host is never an option, whatever its name



def probe_folders(args: argparse.Namespace) -> list[str]:
    """The run's folders for the probe to check, from ``--config``/``key=value`` (none without)."""
    cfg = args.cfg
    if cfg is None:
        return []
    return (["--data-dir", cfg.data.dir] if cfg.data.dir and not cfg.data.synthetic else []) + \
        ["--output-dir", cfg.output.dir]



def probe_host(host: Host, args: argparse.Namespace) -> None:
    """Fill ``host.facts`` (or ``host.problem``) by running ``--probe`` there."""
    python = sys.executable
    forwarded = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    probe = [python, "-m", "hvdtrain", "doctor", "--probe", *probe_folders(args)]
    if args.slurm:  # inside an allocation: a step on that node, not ssh (which may be closed)
        cmd = srun_probe_command(host.name, probe)
    elif is_local(host.name):
        cmd = probe
    else:
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in forwarded.items())
        remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; {exports} {shlex.join(probe)}"
        cmd = ssh_command(host.name, remote, args.ssh_port, args.ssh_identity_file, args.connect_timeout)
    result = run_with_deadline(cmd, args.connect_timeout + PROBE_SECONDS + checks.READ_SECONDS)
    if result.timed_out:
        host.problem = f"no answer within {args.connect_timeout + PROBE_SECONDS + checks.READ_SECONDS:g}s " \
                       f"({'srun' if args.slurm else 'ssh'} or Python hangs)"
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
    # A name on loopback is fine where every host is reached on loopback (one machine), and breaks
    # Gloo across machines.
    if len(hosts) > 1 and not all(h.address and ipaddress.ip_address(h.address).is_loopback for h in hosts):
        from ..comm import launcher_env as launcher

        fix = "for dist.engine=torch alone, GLOO_SOCKET_IFNAME=IFACE"
        problems += [f"{h.name}: " + launcher.loopback_line(h.facts.get("hostname", h.name),
                                                            h.facts["loopback_name"], fix)
                     for h in hosts if h.facts.get("loopback_name")]
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
