"""Step 2 of ``hvdtrain doctor``: allreduce bus bandwidth, measured by a real launch per controller.

``run_bench`` launches ``python -m hvdtrain doctor --bench`` over the hosts with horovodrun; each
rank runs ``bench``, prints a step marker as it gets further (started, joined, one per size), and
rank 0 prints one JSON line of results that ``run_bench`` reads back. A launch that has not
finished by its deadline is ended with everything it started (``run_with_deadline``), and the
markers in its partial output say how far it got (``stall_message``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from ..comm import launcher_env as launcher
from .process import run_with_deadline

RESULT_MARKER = "HVDTRAIN_DOCTOR_BENCH "
# "HVDTRAIN_DOCTOR_STEP <rank> <step>", step: started (the process runs), joined (Horovod's init
# returned: the controller connected every rank), <device>:<bytes> (that size's allreduces done).
STEP_MARKER = "HVDTRAIN_DOCTOR_STEP"
STEP_PATTERN = re.compile(rf"{STEP_MARKER} (\d+) ([a-z]+(?::\d+)?)")


def human_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def iterations_for(size: int, iters: int) -> int:
    """Enough repetitions to time a size well, few enough for large sizes to stay quick."""
    return iters if iters else max(3, min(50, (256 << 20) // size))


# --- the ranks' side ---------------------------------------------------------------------------
def step(rank: int, what: str) -> None:
    print(f"{STEP_MARKER} {rank} {what}", flush=True)


def end_with_launcher(seconds: float) -> None:
    """Let this rank end itself once its launcher is gone or ``seconds`` have passed.

    Killing the ssh client that started a remote rank does not end the rank: sshd sends no
    signal to a command that runs without a terminal, and a rank waiting in a collective never
    writes to the closed pipe either (seen with horovodrun --gloo: both ranks survived, adopted by
    init). The rank notices that its parent changed (the ssh session or Open MPI's daemon ended),
    and as a last resort it stops when the doctor has given up on it anyway.
    """
    parent, stop = os.getppid(), time.monotonic() + seconds

    def watch() -> None:
        while os.getppid() == parent and time.monotonic() < stop:
            time.sleep(0.5)
        why = "its launcher is gone" if os.getppid() != parent else f"{seconds:.0f}s have passed"
        try:
            print(f"hvdtrain doctor: rank {launcher.rank()} ends itself: {why}", file=sys.stderr, flush=True)
        finally:
            os._exit(124)

    threading.Thread(target=watch, name="doctor-lifeline", daemon=True).start()


def bench(sizes: list[int], iters: int, warmup: int, devices: Sequence[str], deadline_seconds: float) -> None:
    """Under a launcher: time allreduce for every size on ``devices`` ("cpu", "cuda"); rank 0 prints
    one JSON line of results. Step markers on every rank tell the doctor how far a stuck job got."""
    step(launcher.rank(), "started")
    end_with_launcher(deadline_seconds)
    import torch

    from ..comm import dist

    dist.init()
    step(dist.rank(), "joined")
    torch.set_num_threads(1)
    devices = [d for d in devices if d == "cpu" or (torch.cuda.is_available() and dist.built()["nccl"])]
    # Every rank must take the GPU path or none: allreduce the decision.
    has_cuda = dist.allreduce_sum(torch.tensor([1 if "cuda" in devices else 0]), name="doctor.cuda")
    if int(has_cuda) != dist.size():
        devices = [d for d in devices if d != "cuda"]
    results: dict[str, list[float]] = {}
    for device in devices:
        if device == "cuda":
            torch.cuda.set_device(dist.local_rank())
        times = []
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
            for i in range(warmup):
                dist.allreduce_sum(tensor, name=f"doctor.warmup.{device}.{size}")
            count = iterations_for(size, iters)
            dist.barrier()
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            for i in range(count):
                out = dist.allreduce_sum(tensor, name=f"doctor.{device}.{size}")
            if device == "cuda":
                torch.cuda.synchronize()
            elapsed = (time.perf_counter() - start) / count
            assert float(out[0]) == dist.size(), "allreduce returned a wrong sum"
            slowest = dist.allreduce_max(torch.tensor([elapsed], dtype=torch.float64), name=f"doctor.t.{device}.{size}")
            times.append(float(slowest))
            step(dist.rank(), f"{device}:{size}")
        results[device] = times
    if dist.is_primary():
        print(RESULT_MARKER + json.dumps({"controller": dist.controller(), "size": dist.size(),
                                          "sizes": sizes, "seconds": results}), flush=True)
    dist.shutdown()


# --- the doctor's side -------------------------------------------------------------------------
def ranks_to_hosts(hosts: Sequence[Any]) -> list[str]:
    """Host name of each rank: horovodrun and mpirun -map-by slot fill the hosts in order."""
    return [h.name for h in hosts for i in range(h.slots)]


def read_steps(output: str) -> dict[int, list[str]]:
    """The step markers in a launch's output, by rank, in order."""
    steps: dict[int, list[str]] = {}
    for rank, what in STEP_PATTERN.findall(output):
        steps.setdefault(int(rank), []).append(what)
    return steps


def reached(hosts: Sequence[Any], steps: dict[int, list[str]], sizes: Sequence[int],
            devices: Sequence[str] = ("cpu",)) -> str:
    """How far a launch got, in words: which hosts' ranks started, joined, finished what."""
    owner = ranks_to_hosts(hosts)

    def names(ranks: set[int]) -> str:
        return ", ".join(dict.fromkeys(owner[r] for r in sorted(ranks) if r < len(owner)))

    everyone = set(range(len(owner)))
    started = {r for r, s in steps.items() if "started" in s}
    joined = {r for r, s in steps.items() if "joined" in s}
    if not started:
        return "no rank started (the launch itself is stuck: ssh, horovodrun's interface check or mpirun's daemons)"
    if everyone - started:
        return f"ranks started on {names(started)} but never on {names(everyone - started)}"
    if everyone - joined:
        stuck = everyone - joined
        return (f"ranks started on {names(started)} but Horovod's init never returned on {names(stuck)} "
                "(the ranks could not connect to each other)")
    # The bench's steps in order; the last one that every rank finished.
    order = [f"{device}:{size}" for device in devices for size in sizes]
    finished = [i for i, what in enumerate(order) if all(what in steps[r] for r in everyone)]
    if not finished:
        return f"ranks started on {names(started)} but no allreduce finished"

    def words(what: str) -> str:
        device, size = what.split(":")
        return f"{human_size(int(size))} on {'gpu' if device == 'cuda' else device}"

    last = finished[-1]
    stuck = f", not {words(order[last + 1])}" if last + 1 < len(order) else ""
    return f"ranks started on {names(started)}; allreduce finished up to {words(order[last])}{stuck}"


def stall_message(controller: str, seconds: float, what: str, devices: Sequence[str], pinned: str | None,
                  chosen: str | None, choices: Sequence[str] = ()) -> str:
    """The one line for a launch ended at its deadline: which controller, how far it got, what to try.

    ``pinned``: the interface the launch was given; ``chosen``: the one that connects the hosts
    (``pick_interface``), or else ``choices``, the interfaces they share.
    """
    other = "gloo" if controller == "mpi" else "mpi"
    if chosen and chosen != pinned:
        tries = [f"--network-interfaces {chosen}" + (f" and NCCL_SOCKET_IFNAME={chosen}" if "cuda" in devices else "")]
    elif pinned:
        tries = [f"checking that {pinned} connects the hosts (`ping` one from the other)"]
    else:
        iface = f"one of {', '.join(choices)}" if choices else "the interface that connects the hosts"
        tries = [f"--network-interfaces IFACE ({iface})"]
    return f"{controller} controller: no result within {seconds:.0f}s: {what}; try {tries[0]}, or --controllers {other}"


def bench_command(controller: str, hosts: Sequence[Any], args: argparse.Namespace, devices: Sequence[str],
                  interface: str | None) -> list[str]:
    bin_dir = Path(sys.executable).parent
    np_ = sum(h.slots for h in hosts)
    cmd = [str(bin_dir / "horovodrun"), "-np", str(np_), "-H", ",".join(f"{h.name}:{h.slots}" for h in hosts),
           f"--{controller}", "--verbose"]
    if interface:
        cmd += ["--network-interfaces", interface]
    if args.ssh_port:
        cmd += ["--ssh-port", str(args.ssh_port)]
    if args.ssh_identity_file:
        cmd += ["--ssh-identity-file", args.ssh_identity_file]
    return cmd + [sys.executable, *bench_arguments(args, devices)]


def bench_arguments(args: argparse.Namespace, devices: Sequence[str]) -> list[str]:
    """What each rank runs after its Python (under horovodrun, or srun: allreduce_slurm.py)."""
    return ["-m", "hvdtrain", "doctor", "--bench", "--sizes", args.sizes, "--iters", str(args.iters),
            "--warmup", str(args.warmup), "--devices", ",".join(devices), "--bench-timeout", str(args.bench_timeout)]


def run_bench(controller: str, hosts: Sequence[Any], args: argparse.Namespace, sizes: Sequence[int],
              devices: Sequence[str] = ("cpu",), interface: str | None = None, chosen: str | None = None,
              choices: Sequence[str] = ()) -> tuple[dict | None, str]:
    """One launch with ``controller``: (results, "") or (None, one line saying what went wrong).

    ``interface``: what horovodrun is told (--network-interfaces); ``chosen`` and ``choices``: what
    ``pick_interface`` found, for the message when the launch hangs.
    """
    bin_dir = Path(sys.executable).parent
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    if interface and controller == "mpi":
        # horovodrun passes btl_tcp_if_include for MPI's traffic; pin Open MPI's own channel
        # (daemons, wire-up) to the same interface.
        env.setdefault("OMPI_MCA_oob_tcp_if_include", interface)
    finished = run_with_deadline(bench_command(controller, hosts, args, devices, interface), args.bench_timeout, env)
    for line in finished.stdout.splitlines():
        if RESULT_MARKER in line:
            # Output of other ranks may follow on the same line: decode the one object only.
            return json.JSONDecoder().raw_decode(line.split(RESULT_MARKER, 1)[1])[0], ""
    if finished.timed_out:
        what = reached(hosts, read_steps(finished.stdout), sizes, devices)
        return None, stall_message(controller, args.bench_timeout, what, devices, interface, chosen, choices)
    output = [line for line in (finished.stderr.strip() or finished.stdout.strip()).splitlines()
              if STEP_MARKER not in line]
    return None, f"{controller} controller: horovodrun exited {finished.returncode}: {' | '.join(output[-3:])}"


# --- the table ---------------------------------------------------------------------------------
def bus_bandwidth(size: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth for allreduce, in bytes/s: algbw x 2(n-1)/n."""
    return size / seconds * 2 * (ranks - 1) / ranks


def column_name(controller: str, device: str) -> str:
    """GPU tensors go through NCCL whichever controller coordinates the job: name them after it."""
    return "nccl/gpu" if device == "cuda" else f"{controller}/{device}"


def print_bandwidth(results: list[dict]) -> str:
    """The table of bus bandwidths (CPU columns per controller, then NCCL); returns the fastest column's name."""
    columns = [(column_name(r["controller"], device), times) for r in results for device, times in r["seconds"].items()]
    columns.sort(key=lambda column: column[0] == "nccl/gpu")
    sizes = results[0]["sizes"]
    ranks = results[0]["size"]
    table = {name: [bus_bandwidth(s, t, ranks) for s, t in zip(sizes, times)] for name, times in columns}
    peak = max(max(values) for values in table.values())
    unit, scale = ("GB/s", 1e9) if peak >= 1e9 else ("MB/s", 1e6)
    print(f"\nallreduce (sum, float32) over {ranks} ranks: bus bandwidth in {unit} "
          f"(nccl-tests: busbw = size/time x 2(n-1)/n)")
    print(f"{'size':>10}  " + "  ".join(f"{name:>12}" for name in table))
    for i, size in enumerate(sizes):
        # Significant digits, not decimals: a small size measured on a loaded host (0.3 MB/s in a GB/s
        # table) must not print as 0.000.
        print(f"{human_size(size):>10}  " + "  ".join(f"{table[name][i] / scale:>12.4g}" for name in table))
    fastest = max(table, key=lambda name: table[name][-1])
    print(f"fastest at {human_size(sizes[-1])}: {fastest} ({table[fastest][-1] / scale:.3f} {unit})")
    return fastest
