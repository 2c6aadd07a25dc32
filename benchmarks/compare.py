"""``make bench``: hvdtrain against a raw PyTorch loop and PyTorch DDP, side by side, in one go.

Contenders (same model, per-rank batch, image size and threads per rank; synthetic data):
  raw            one process, the minimal loop of benchmarks/torch_loop.py
  hvdtrain-1     python -m hvdtrain bench, one process
  ddp-2          torchrun --nproc_per_node 2 benchmarks/torch_loop.py (DistributedDataParallel, Gloo)
  hvdtrain-2-*   horovodrun -np 2 --gloo / --mpi python -m hvdtrain bench, without and with fp16
                 gradient compression
  hvdtrain-1-untimed  hvdtrain-1 with runtime.phase_timing=false (the cost of timing step phases)

Every round runs each contender once, in an order rotated every round, so that slow drift of the
machine (other jobs, thermals) spreads over all of them. The table shows medians over rounds and
the ratios the targets are about; results go to OUT/bench.json and OUT/bench.png.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from hvdtrain.tools.bench import interval95  # noqa: E402

BIN = Path(sys.executable).parent
LOOP = REPO / "benchmarks" / "torch_loop.py"

TARGETS = {  # contender: (reference, minimum ratio)
    "hvdtrain-1": ("raw", 0.97),
    "hvdtrain-2-gloo": ("ddp-2", 1.0),
    "hvdtrain-2-mpi": ("ddp-2", 1.0),
    "hvdtrain-2-gloo-fp16": ("ddp-2", None),
    "hvdtrain-2-mpi-fp16": ("ddp-2", None),
    "hvdtrain-1-untimed": ("hvdtrain-1", None),  # runtime.phase_timing=false: what timing the phases costs
}


def contenders(args: argparse.Namespace) -> dict[str, tuple[int, list[str]]]:
    """name -> (ranks, command)."""
    python = str(BIN / "python")
    loop = [str(LOOP), "--arch", args.arch, "--batch-size", str(args.batch_size), "--image-size",
            str(args.image_size), "--threads", str(args.threads), "--warmup-steps", str(args.warmup_steps),
            "--steps", str(args.steps)]
    bench = ["-m", "hvdtrain", "bench", "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps),
             "--repeats", "1", f"model.arch={args.arch}", f"train.batch_size={args.batch_size}",
             f"data.image_size={args.image_size}", f"runtime.threads={args.threads}", "runtime.device=cpu"]
    horovodrun = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2"]
    return {
        "raw": (1, [python, *loop]),
        "hvdtrain-1": (1, [python, *bench]),
        "hvdtrain-1-untimed": (1, [python, *bench, "runtime.phase_timing=false"]),
        "ddp-2": (2, [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *loop]),
        "hvdtrain-2-gloo": (2, [*horovodrun, "--gloo", python, *bench, "dist.compression=none"]),
        "hvdtrain-2-gloo-fp16": (2, [*horovodrun, "--gloo", python, *bench, "dist.compression=fp16"]),
        "hvdtrain-2-mpi": (2, [*horovodrun, "--mpi", python, *bench, "dist.compression=none"]),
        "hvdtrain-2-mpi-fp16": (2, [*horovodrun, "--mpi", python, *bench, "dist.compression=fp16"]),
    }


def job_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    python_path = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # the caller's stays after it
    env.update({"PYTHONPATH": python_path, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
                "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"})
    if os.geteuid() == 0:  # containers run as root; Open MPI refuses that unless told
        env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"})
    env.setdefault("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
    return env


AUDIT_LINE = re.compile(r"bench: cross-rank audit: ([\d.]+) ms each \((\d+) values\), ([\d.]+)% of one step")


def run_once(command: list[str], env: dict[str, str], timeout: int) -> tuple[float, dict[str, float]]:
    """One run's img/s, and what its cross-rank audit cost (hvdtrain on 2 ranks: ms, share of a step)."""
    result = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    found = re.findall(r"images_per_sec=([\d.]+)", result.stdout)
    if result.returncode != 0 or not found:
        raise SystemExit(f"bench: '{' '.join(command)}' failed (exit {result.returncode}):\n"
                         f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    audit = AUDIT_LINE.search(result.stdout)
    return float(found[-1]), ({"ms": float(audit.group(1)), "values": int(audit.group(2)),
                               "step_fraction": float(audit.group(3)) / 100} if audit else {})


def load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def summarize(samples: dict[str, list[float]]) -> dict[str, dict]:
    """Medians, and each contender's ratio to its reference. Every round runs every contender once, so
    run i of one is paired with run i of its reference: the machine's drift between rounds cancels
    in those per-round ratios ("paired": their median, and their mean with a 95% interval). The
    verdict against the target is on the paired median."""
    rows = {name: {"median": statistics.median(v), "min": min(v), "max": max(v), "runs": v}
            for name, v in samples.items()}
    for name, (reference, target) in TARGETS.items():
        if name in rows and reference in rows:
            row = rows[name]
            per_round = [v / r for v, r in zip(samples[name], samples[reference])]
            row.update(ratio_to=reference, ratio=row["median"] / rows[reference]["median"], target=target,
                       paired_ratios=per_round, paired=statistics.median(per_round))
            row["paired_mean"], row["paired_ci95"] = interval95(per_round)
    scaling = {}
    for two, one in (("hvdtrain-2-gloo", "hvdtrain-1"), ("hvdtrain-2-mpi", "hvdtrain-1"), ("ddp-2", "raw")):
        if two in rows and one in rows:
            scaling[f"{two} vs {one}"] = rows[two]["median"] / (2 * rows[one]["median"])
    return {"contenders": rows, "weak_scaling_efficiency": scaling}


def table(summary: dict) -> list[str]:
    lines = [f"{'contender':<22} {'ranks':>5} {'median img/s':>13} {'min..max':>15}  ratio of medians; paired "
             "per round: median, mean +- 95%", "-" * 108]
    for name, row in summary["contenders"].items():
        ratio = ""
        if "ratio" in row:
            target = row["target"]
            verdict = "" if target is None else ("  ok" if row["paired"] >= target else f"  BELOW target {target}")
            ratio = (f"{row['ratio']:.3f} of {row['ratio_to']}; paired {row['paired']:.3f}, "
                     f"{row['paired_mean']:.3f} +- {row['paired_ci95']:.3f}{verdict}")
        lines.append(f"{name:<22} {row['ranks']:>5} {row['median']:>13.2f} "
                     f"{row['min']:>7.2f}..{row['max']:<7.2f}  {ratio}")
    lines.append("weak-scaling efficiency (2 ranks / (2 x 1 rank), same per-rank work):")
    for name, value in summary["weak_scaling_efficiency"].items():
        lines.append(f"  {name:<30} {value:.3f}")
    return lines


def markdown(summary: dict) -> list[str]:
    """The table as Markdown, for a result in benchmarks/results/."""
    lines = ["| contender | ranks | median img/s | min..max | ratio of medians | paired: median, mean +- 95% |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name, row in summary["contenders"].items():
        ratio = paired = ""
        if "ratio" in row:
            ratio = f"{row['ratio']:.3f} of {row['ratio_to']}"
            paired = f"{row['paired']:.3f}, {row['paired_mean']:.3f} +- {row['paired_ci95']:.3f}"
        if row.get("target") is not None:
            paired += f" (target {row['target']}: {'met' if row['paired'] >= row['target'] else 'not met'})"
        lines.append(f"| {name} | {row['ranks']} | {row['median']:.2f} | {row['min']:.2f}..{row['max']:.2f} | {ratio} "
                     f"| {paired} |")
    lines.append("")
    lines.append("| weak-scaling efficiency (2 ranks / (2 x 1 rank)) | |")
    lines.append("| --- | --- |")
    for name, value in summary["weak_scaling_efficiency"].items():
        lines.append(f"| {name} | {value:.3f} |")
    return lines


def chart(summary: dict, settings: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["contenders"]
    names = list(rows)
    medians = [rows[n]["median"] for n in names]
    low = [rows[n]["median"] - rows[n]["min"] for n in names]
    high = [rows[n]["max"] - rows[n]["median"] for n in names]
    colours = ["#888888" if not n.startswith("hvdtrain") else "#1f77b4" for n in names]
    figure, axis = plt.subplots(figsize=(9, 4), dpi=80)
    axis.bar(names, medians, yerr=[low, high], color=colours, capsize=4)
    for x, (name, value) in enumerate(zip(names, medians)):
        label = f"{value:.1f}" + (f"\n{rows[name]['paired']:.2f}x" if "paired" in rows[name] else "")
        axis.text(x, value * 0.5, label, ha="center", fontsize=8, color="white")
    axis.set_ylabel("images / s (median, min-max bars)")
    axis.set_title(settings, fontsize=10)
    axis.tick_params(axis="x", labelrotation=25, labelsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description="hvdtrain vs a raw loop and DDP, alternating, on this machine.")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every contender")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per run")
    parser.add_argument("--only", help="comma-separated contenders to run (default: all)")
    parser.add_argument("--out", default="runs/bench", help="folder for bench.json and bench.png")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = parser.parse_args()

    every = contenders(args)
    names = list(every) if not args.only else [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"bench: unknown contender(s) {unknown} (choose from {', '.join(every)})")
    env = job_env(args.threads)
    settings = (f"{args.arch} {args.image_size}px, batch {args.batch_size}/rank, {args.threads} thread(s)/rank, "
                f"{args.steps} timed steps after {args.warmup_steps} warm-up, {args.rounds} rounds")
    print(f"bench: {settings}; {os.cpu_count()} CPUs; load {load():.2f} at start", flush=True)
    samples: dict[str, list[float]] = {n: [] for n in names}
    audits: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    loads = [load()]
    start = time.perf_counter()
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[:round_index % len(names)]
        for name in order:
            value, audit = run_once(every[name][1], env, args.timeout)
            samples[name].append(value)
            if audit:
                audits[name].append(audit)
            loads.append(load())
            print(f"bench: round {round_index + 1}/{args.rounds} {name:<22} {value:8.2f} img/s "
                  f"(load {loads[-1]:.2f}, {time.perf_counter() - start:.0f}s)", flush=True)
    summary = summarize(samples)
    for name in summary["contenders"]:
        summary["contenders"][name]["ranks"] = every[name][0]
    summary.update(settings=vars(args), load_1min=loads, seconds=time.perf_counter() - start,
                   commands={n: every[n][1] for n in names},
                   audit={n: {"ms": statistics.median(a["ms"] for a in found), "values": found[0]["values"],
                              "step_fraction": statistics.median(a["step_fraction"] for a in found)}
                          for n, found in audits.items() if found})
    print()
    for line in table(summary):
        print(line)
    for name, audit in summary["audit"].items():
        print(f"cross-rank audit, {name}: {audit['ms']:.1f} ms per audit ({audit['values']} values), "
              f"{100 * audit['step_fraction']:.2f}% of one step (median over rounds); at the default, once per "
              f"epoch and checkpoint, that is under 0.5% of the step time from "
              f"{max(1, math.ceil(audit['step_fraction'] / 0.005))} steps per epoch on")
    print(f"load (1-min average) during the runs: {min(loads):.2f}..{max(loads):.2f}; "
          f"{summary['seconds'] / 60:.1f} minutes")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "bench.md").write_text("\n".join(markdown(summary)) + "\n")
    chart(summary, settings, out / "bench.png")
    print(f"bench: wrote {out / 'bench.json'}, {out / 'bench.md'} and {out / 'bench.png'}")


if __name__ == "__main__":
    main()
