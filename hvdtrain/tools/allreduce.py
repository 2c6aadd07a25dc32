"""Step 2 of ``hvdtrain doctor``: allreduce bus bandwidth, measured by a real launch per controller.

``run_bench`` launches ``python -m hvdtrain doctor --bench`` over the hosts with horovodrun; each
rank runs ``bench``, and rank 0 prints one JSON line that ``run_bench`` reads back.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

RESULT_MARKER = "HVDTRAIN_DOCTOR_BENCH "


def human_size(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def iterations_for(size: int, iters: int) -> int:
    """Enough repetitions to time a size well, few enough for large sizes to stay quick."""
    return iters if iters else max(3, min(50, (256 << 20) // size))


def bench(sizes: list[int], iters: int, warmup: int) -> None:
    """Under a launcher: time allreduce for every size; rank 0 prints one JSON line of results."""
    import torch

    from .. import dist

    dist.init()
    torch.set_num_threads(1)
    devices = ["cpu"]
    if torch.cuda.is_available() and dist.built()["nccl"]:
        devices.append("cuda")
    # Every rank must take the GPU path or none: allreduce the decision.
    has_cuda = dist.allreduce_sum(torch.tensor([1 if "cuda" in devices else 0]), name="doctor.cuda")
    if int(has_cuda) != dist.size():
        devices = ["cpu"]
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
        results[device] = times
    if dist.is_primary():
        print(RESULT_MARKER + json.dumps({"controller": dist.controller(), "size": dist.size(),
                                          "sizes": sizes, "seconds": results}), flush=True)
    dist.shutdown()


def bus_bandwidth(size: int, seconds: float, ranks: int) -> float:
    """nccl-tests' bus bandwidth for allreduce, in bytes/s: algbw x 2(n-1)/n."""
    return size / seconds * 2 * (ranks - 1) / ranks


def run_bench(controller: str, hosts: Sequence[Any], args: argparse.Namespace) -> tuple[dict | None, str]:
    bin_dir = Path(sys.executable).parent
    horovodrun = str(bin_dir / "horovodrun")
    np_ = sum(h.slots for h in hosts)
    cmd = [horovodrun, "-np", str(np_), "-H", ",".join(f"{h.name}:{h.slots}" for h in hosts), f"--{controller}"]
    if args.network_interfaces:
        cmd += ["--network-interfaces", args.network_interfaces]
    if args.ssh_port:
        cmd += ["--ssh-port", str(args.ssh_port)]
    if args.ssh_identity_file:
        cmd += ["--ssh-identity-file", args.ssh_identity_file]
    cmd += [sys.executable, "-m", "hvdtrain", "doctor", "--bench", "--sizes", args.sizes,
            "--iters", str(args.iters), "--warmup", str(args.warmup)]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.bench_timeout)
    except subprocess.TimeoutExpired:
        return None, f"no result within {args.bench_timeout}s"
    for line in result.stdout.splitlines():
        if RESULT_MARKER in line:
            # Output of other ranks may follow on the same line: decode the one object only.
            return json.JSONDecoder().raw_decode(line.split(RESULT_MARKER, 1)[1])[0], ""
    output = (result.stderr.strip() or result.stdout.strip()).splitlines()
    return None, f"horovodrun exited {result.returncode}: {' | '.join(output[-3:])}"


def print_bandwidth(results: list[dict]) -> str:
    """The table of bus bandwidths; returns the fastest column's name."""
    columns = [(f"{r['controller']}/{device}", r, device) for r in results for device in r["seconds"]]
    sizes = results[0]["sizes"]
    ranks = results[0]["size"]
    table = {name: [bus_bandwidth(s, t, ranks) for s, t in zip(sizes, r["seconds"][device])]
             for name, r, device in columns}
    peak = max(max(values) for values in table.values())
    unit, scale = ("GB/s", 1e9) if peak >= 1e9 else ("MB/s", 1e6)
    print(f"\nallreduce (sum, float32) over {ranks} ranks: bus bandwidth in {unit} "
          f"(nccl-tests: busbw = size/time x 2(n-1)/n)")
    print(f"{'size':>10}  " + "  ".join(f"{name:>12}" for name, _, _ in columns))
    for i, size in enumerate(sizes):
        print(f"{human_size(size):>10}  " + "  ".join(f"{table[name][i] / scale:>12.3f}" for name, _, _ in columns))
    fastest = max(table, key=lambda name: table[name][-1])
    print(f"fastest at {human_size(sizes[-1])}: {fastest} ({table[fastest][-1] / scale:.3f} {unit})")
    return fastest
