"""A plain PyTorch training step with glibc's malloc defaults against the same with hvdtrain's tuning.

    python benchmarks/host_malloc.py --pairs 4                  # resnet18, 224 px, batch 16, 1 thread

Each pair runs two fresh processes, in an order that alternates from pair to pair: one with glibc's
defaults, one that first applies ``runtime.host_malloc=tuned`` (hvdtrain/launch/host_malloc.py)
and nothing else of hvdtrain. Both then train the same model on the same synthetic batch (SGD
with momentum, as benchmarks/torch_loop.py). Printed per run: minor page faults per timed step
(each a page the kernel maps and zeroes), seconds per step and the process's peak memory; then
the medians and the paired ratio of step times, tuned / defaults. Results go to
OUT/host_malloc.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = ("defaults", "tuned")


def child(args: argparse.Namespace) -> None:
    said = None
    if args.child == "tuned":
        from hvdtrain.launch import host_malloc
        said = host_malloc.apply("tuned", "cpu")
        if said != "tuned":
            raise SystemExit(f"host_malloc: {said}")
    import torch
    import torch.nn.functional as F
    from torchvision import models

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = models.get_model(args.arch, weights=None, num_classes=1000)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 1000, (args.batch_size,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    for _ in range(args.warmup_steps):
        step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = time.perf_counter() - start
    usage = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"mode": args.child, "steps": args.steps, "seconds_per_step": seconds / args.steps,
                      "faults_per_step": (usage.ru_minflt - faults) / args.steps,
                      "peak_rss_mb": usage.ru_maxrss / 1024, "malloc": said}))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return {}
    # glibc's variables would decide for both contenders: the defaults must be glibc's own.
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("MALLOC_") and key not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    env.update({"OMP_NUM_THREADS": str(args.threads),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))})
    command = [sys.executable, __file__, "--arch", args.arch, "--image-size", str(args.image_size),
               "--batch-size", str(args.batch_size), "--threads", str(args.threads),
               "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps)]
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    print(f"host_malloc: {args.arch} {args.image_size}px, batch {args.batch_size}, {args.threads} thread(s), "
          f"{args.steps} timed steps after {args.warmup_steps}, {args.pairs} pairs", flush=True)
    for pair in range(args.pairs):
        for mode in (MODES if pair % 2 == 0 else MODES[::-1]):
            out = subprocess.run([*command, "--child", mode], env=env, capture_output=True, text=True, check=True)
            run = json.loads(out.stdout.strip().splitlines()[-1])
            runs[mode].append(run)
            print(f"pair {pair + 1} {mode:>8}: {run['seconds_per_step']:.3f} s/step, "
                  f"{run['faults_per_step']:,.0f} faults/step, peak {run['peak_rss_mb']:,.0f} MB", flush=True)
    ratios = [t["seconds_per_step"] / d["seconds_per_step"] for d, t in zip(runs["defaults"], runs["tuned"])]
    summary = {mode: {key: statistics.median(r[key] for r in runs[mode])
                      for key in ("seconds_per_step", "faults_per_step", "peak_rss_mb")} for mode in MODES}
    for mode in MODES:
        s = summary[mode]
        print(f"median {mode:>8}: {s['seconds_per_step']:.3f} s/step, {s['faults_per_step']:,.0f} faults/step, "
              f"peak {s['peak_rss_mb']:,.0f} MB")
    print(f"step time tuned / defaults: paired median {statistics.median(ratios):.3f} "
          f"(per pair {', '.join(f'{r:.3f}' for r in ratios)})")
    result = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "runs": runs, "median": summary,
              "paired_ratios": ratios}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "host_malloc.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
