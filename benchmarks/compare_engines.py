"""hvdtrain's two engines and plain DDP on the same work, alternating, on this machine (CPU, Gloo).

Contenders (2 ranks each; same model, per-rank batch, image size, threads per rank; synthetic data;
no gradient compression):
  horovod   horovodrun -np 2 --gloo python -m hvdtrain bench               (dist.engine=horovod)
  torch     torchrun --nproc_per_node 2 -m hvdtrain bench dist.engine=torch
  ddp       torchrun --nproc_per_node 2 benchmarks/torch_loop.py           (DistributedDataParallel)

Every round runs each contender once, in an order rotated every round, so that the machine's drift
spreads over all of them; the ratios are taken per round (paired) and their median reported. Each
run's JSON says how many steps and samples it timed; a run that timed fewer than asked stops the
benchmark. Results: OUT/compare_engines.json.

    python benchmarks/compare_engines.py --rounds 3 --steps 10 --image-size 112 --out runs/engines
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.compare import job_env, load  # noqa: E402

BIN = Path(sys.executable).parent
LOOP = REPO / "benchmarks" / "torch_loop.py"
RATIOS = (("torch", "horovod"), ("torch", "ddp"), ("horovod", "ddp"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def command(name: str, args: argparse.Namespace, result: Path) -> list[str]:
    """The argv of one run of contender ``name`` that writes its JSON to ``result``."""
    python = str(BIN / "python")
    torchrun = [python, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port())]
    bench = ["-m", "hvdtrain", "bench", "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps),
             "--repeats", "1", "--json", str(result), f"model.arch={args.arch}", f"train.batch_size={args.batch_size}",
             f"data.image_size={args.image_size}", f"runtime.threads={args.threads}", "runtime.device=cpu",
             "dist.compression=none"]
    if name == "horovod":
        return [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", python, *bench]
    if name == "torch":
        return [*torchrun, *bench, "dist.engine=torch"]
    if name == "ddp":
        return [*torchrun, str(LOOP), "--arch", args.arch, "--batch-size", str(args.batch_size), "--image-size",
                str(args.image_size), "--threads", str(args.threads), "--warmup-steps", str(args.warmup_steps),
                "--steps", str(args.steps), "--json", str(result)]
    raise ValueError(name)


def run_once(name: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    """One run: its images/s and the steps and samples it timed (checked against what was asked)."""
    with tempfile.TemporaryDirectory() as folder:
        result = Path(folder) / "result.json"
        argv = command(name, args, result)
        job_env = {**env, "HVDTRAIN_JOB_SECRET": secrets.token_hex(32)}  # the torch engine's, one per job
        done = subprocess.run(argv, env=job_env, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
        if done.returncode != 0 or not result.exists():
            raise SystemExit(f"compare_engines: '{' '.join(argv)}' failed (exit {done.returncode}):\n"
                             f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        found = json.loads(result.read_text())
    steps = found["steps"] if name == "ddp" else sum(found["steps_run"])
    samples = found["samples"] if name == "ddp" else sum(found["samples_run"])
    expected = args.steps * args.batch_size * 2
    if steps != args.steps or samples != expected:
        raise SystemExit(f"compare_engines: {name} timed {steps} steps and {samples} samples, not {args.steps} "
                         f"and {expected}")
    return {"images_per_sec": found["images_per_sec"], "steps": steps, "samples": samples}


def summarize(runs: dict[str, list[dict]]) -> dict:
    """Medians per contender, and per-round (paired) ratios of images/s for RATIOS."""
    rates = {name: [r["images_per_sec"] for r in found] for name, found in runs.items()}
    summary = {"contenders": {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": found}
                              for (name, v), found in zip(rates.items(), runs.values())}, "ratios": {}}
    for top, bottom in RATIOS:
        if top in rates and bottom in rates:
            paired = [a / b for a, b in zip(rates[top], rates[bottom])]
            summary["ratios"][f"{top}/{bottom}"] = {"paired_median": statistics.median(paired), "paired": paired}
    return summary


def round_order(names: list[str], round_index: int) -> list[str]:
    """The contenders in round ``round_index``: the list rotated by one each round, so that each
    contender runs first, second and third equally often and the machine's drift spreads over all."""
    shift = round_index % len(names)
    return names[shift:] + names[:shift]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--only", default="horovod,torch,ddp", help="comma-separated contenders")
    parser.add_argument("--out", default="runs/compare_engines")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - {"horovod", "torch", "ddp"})
    if unknown:
        raise SystemExit(f"compare_engines: unknown contender(s) {unknown} (choose from horovod, torch, ddp)")
    env = job_env(args.threads)
    settings = (f"{args.arch} {args.image_size}px, batch {args.batch_size}/rank x 2 ranks, {args.threads} "
                f"thread(s)/rank, {args.steps} timed steps after {args.warmup_steps}, {args.rounds} rounds")
    print(f"compare_engines: {settings}; {os.cpu_count()} CPUs; load {load():.2f}", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    start = time.perf_counter()
    for round_index in range(args.rounds):
        for name in round_order(names, round_index):
            runs[name].append(run_once(name, args, env))
            print(f"compare_engines: round {round_index + 1}/{args.rounds} {name:<8} "
                  f"{runs[name][-1]['images_per_sec']:8.2f} img/s (load {load():.2f}, "
                  f"{time.perf_counter() - start:.0f}s)", flush=True)
    summary = summarize(runs)
    summary.update(settings=vars(args), seconds=time.perf_counter() - start)
    for name, row in summary["contenders"].items():
        print(f"{name:<8} median {row['median']:8.2f} img/s ({row['min']:.2f}..{row['max']:.2f})")
    for name, ratio in summary["ratios"].items():
        print(f"{name:<14} paired median {ratio['paired_median']:.3f} "
              f"({', '.join(f'{r:.3f}' for r in ratio['paired'])})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare_engines.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"compare_engines: wrote {out / 'compare_engines.json'}")


if __name__ == "__main__":
    main()
