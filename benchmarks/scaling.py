"""``make bench-scaling``: how close to 2x two nodes come over a real link, against the link's limit.

Two nodes on this machine (tests/multinode/netns.py: network namespaces joined by a veth pair
limited with tbf, one core and one sshd per node). At each link rate of the sweep, every contender
runs on 1 node and on 2 nodes (1 rank and 1 core per node, the same work per rank):

  hvdtrain-horovod       python -m hvdtrain bench (defaults); 2 nodes: horovodrun -H node0:1,node1:1 --gloo
  hvdtrain-horovod-fp16  the same with dist.compression=fp16
  hvdtrain-torch         torchrun -m hvdtrain bench dist.engine=torch (2 nodes: torchrun --nnodes 2 on each)
  ddp                    benchmarks/torch_loop.py: one process; 2 nodes: DistributedDataParallel (Gloo)
  ddp-fp16               the same with torch's fp16_compress_hook
  horovod-synthetic      Horovod's own pytorch_synthetic_benchmark.py, unchanged, --no-cuda (its images
                         are 224 px whatever --image-size says); found in shared/peers/horovod/ beside
                         the checkout, or --horovod-script

The contenders' order rotates every round. A run's own count of the steps and samples it timed is
checked against what was asked. Scaling factor = 2-node img/s / (2 x 1-node img/s), per round. The
limit is hvdtrain/observe/forecast.py's: T / max(T, ring allreduce time), T the contender's measured
1-node step, the gradients' bytes (halved for the fp16 contenders) over the link's measured rate. A
contender that fails is said so in one line (its logs kept in OUT/failed/), and the sweep goes on.
Results: OUT/scaling.json, OUT/scaling.md and OUT/scaling.png (scaling factor against link rate, the
limits dashed).

    python benchmarks/scaling.py --rates 0.25,1,4,unlimited --rounds 3 --out runs/scaling
    python benchmarks/scaling.py --harness /tmp/hvdtrain-netns ...   # nodes already started, at their rate
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.compare import load  # noqa: E402
from benchmarks.compare_engines import round_order  # noqa: E402
from hvdtrain.observe.forecast import scaling_limit  # noqa: E402
from tests.multinode.netns import NetNodes, unavailable_reason  # noqa: E402

BIN = Path(sys.executable).parent
PYTHON = str(BIN / "python")
LOOP = REPO / "benchmarks" / "torch_loop.py"
CONTENDERS = ("hvdtrain-horovod", "hvdtrain-horovod-fp16", "hvdtrain-torch", "ddp", "ddp-fp16", "horovod-synthetic")
FP16 = ("hvdtrain-horovod-fp16", "ddp-fp16")
REFERENCE = "hvdtrain-horovod"  # whose 1-node step gives the plot's limit lines
SYNTHETIC_TOTAL = re.compile(r"Total img/sec on (\d+) CPU\(s\): ([\d.]+)")


def horovod_script() -> Path | None:
    """Horovod's pytorch_synthetic_benchmark.py in shared/peers/horovod/ beside the checkout (or above)."""
    for folder in REPO.parents:
        found = folder / "shared" / "peers" / "horovod" / "pytorch_synthetic_benchmark.py"
        if found.is_file():
            return found
    return None


def parse_rates(text: str) -> list[float | None]:
    """``0.25,1,unlimited`` -> Gbit/s each (None: no tbf, the veth's own speed)."""
    rates: list[float | None] = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        if item in ("unlimited", "none", "0"):
            rates.append(None)
            continue
        try:
            value = float(item)
        except ValueError:
            value = -1
        if not value > 0:
            raise SystemExit(f"scaling: --rates: {item!r} is not a rate in Gbit/s (e.g. 0.25,1,4,unlimited)")
        rates.append(value)
    return rates


def commands(name: str, nodes: int, args: argparse.Namespace, result: Path, harness: NetNodes,
             port: int) -> list[list[str]]:
    """The argv of one run: one command on node0 (a single process, or horovodrun reaching node1 over
    ssh), or, for torchrun on 2 nodes, one per node."""
    bench = ["-m", "hvdtrain", "bench", "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps),
             "--repeats", "1", "--json", str(result), f"model.arch={args.arch}", f"train.batch_size={args.batch_size}",
             f"data.image_size={args.image_size}", "runtime.threads=1", "runtime.device=cpu"]
    loop = [str(LOOP), "--arch", args.arch, "--batch-size", str(args.batch_size), "--image-size",
            str(args.image_size), "--threads", "1", "--warmup-steps", str(args.warmup_steps), "--steps",
            str(args.steps), "--json", str(result)]
    if name.startswith("hvdtrain-horovod"):
        program = bench + (["dist.compression=fp16"] if name in FP16 else [])
        return [[PYTHON, *program]] if nodes == 1 else [harness.horovodrun_argv(program)]
    if name == "horovod-synthetic":
        program = [str(args.horovod_script), "--no-cuda", "--model", args.arch, "--batch-size", str(args.batch_size),
                   "--num-warmup-batches", str(args.warmup_steps), "--num-batches-per-iter", str(args.steps),
                   "--num-iters", "1"]
        return [[PYTHON, *program]] if nodes == 1 else [harness.horovodrun_argv(program)]
    if name == "hvdtrain-torch":
        program = [*bench, "dist.engine=torch"]
    elif name.startswith("ddp"):
        if nodes == 1:
            return [[PYTHON, *loop]]  # one process: the plain loop, no DDP
        program = loop + (["--fp16-hook"] if name in FP16 else [])
    else:
        raise ValueError(name)
    torchrun = [PYTHON, "-m", "torch.distributed.run", "--nproc_per_node", "1"]
    if nodes == 1:
        return [[*torchrun, "--standalone", *program]]
    return [[*torchrun, "--nnodes", "2", "--node_rank", str(rank), "--master_addr", "node0", "--master_port",
             str(port), *program] for rank in range(2)]


def execute(harness: NetNodes, argvs: list[list[str]], cwd: Path, env: dict[str, str],
            timeout: float) -> tuple[int | str, str]:
    """Run one job on the nodes (a command per node, all at once): the first non-zero exit code, or
    "timed out after Ns", and the nodes' output. A node that fails ends the others' wait for it."""
    logs = [cwd / f"node{i}.log" for i in range(len(argvs))]
    processes = []
    try:
        for i, (argv, log) in enumerate(zip(argvs, logs)):
            with open(log, "w") as handle:
                processes.append(subprocess.Popen(harness.prefix(f"node{i}", cwd) + argv, cwd=cwd, env=env,
                                                  stdout=handle, stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + timeout
        while True:
            codes = [process.poll() for process in processes]
            failed = [c for c in codes if c not in (None, 0)]
            if failed or None not in codes:
                code: int | str = failed[0] if failed else 0
                break
            if time.monotonic() > deadline:
                code = f"timed out after {timeout:.0f}s"
                break
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, 9)
                process.wait()
    return code, "\n".join(log.read_text(errors="replace") for log in logs)


def parse(name: str, result: Path, output: str, args: argparse.Namespace) -> dict:
    """images/s and the steps and samples the run timed, by its own count."""
    if name == "horovod-synthetic":  # its lines: "Iter #i: ..." per timed iteration, then the total
        total = SYNTHETIC_TOTAL.search(output)
        if not total:
            raise ValueError("no 'Total img/sec' line")
        steps = len(re.findall(r"^(?:\[\d+\]<stdout>:)?Iter #\d+:", output, re.M)) * args.steps  # horovodrun's prefix
        return {"images_per_sec": float(total.group(2)), "steps": steps,
                "samples": steps * args.batch_size * int(total.group(1))}
    if not result.exists():
        raise ValueError(f"no {result.name} written")
    found = json.loads(result.read_text())
    if name.startswith("ddp"):
        return {"images_per_sec": found["images_per_sec"], "steps": found["steps"], "samples": found["samples"]}
    return {"images_per_sec": found["images_per_sec"], "steps": sum(found["steps_run"]),
            "samples": sum(found["samples_run"])}


def run_once(name: str, nodes: int, args: argparse.Namespace, harness: NetNodes, port: int) -> dict:
    """One run of a contender on 1 or 2 nodes: its figures, or {"error": one line}."""
    if name == "horovod-synthetic" and args.horovod_script is None:
        return {"error": "Horovod's pytorch_synthetic_benchmark.py not found in shared/peers/horovod/ beside "
                         "the checkout: give --horovod-script PATH"}
    cwd = Path(tempfile.mkdtemp(prefix=f"{name}-{nodes}-", dir=args.work))
    result = cwd / "result.json"
    env = {**harness.env(cwd), "GLOO_SOCKET_IFNAME": harness.iface}  # torch's Gloo on the link, as on a cluster
    code, output = execute(harness, commands(name, nodes, args, result, harness, port), cwd, env, args.timeout)
    found: dict = {}
    if code != 0:
        last = [line for line in output.splitlines() if line.strip()][-1:] or [""]
        found["error"] = f"exit {code}: {last[0].strip()[:300]}" if isinstance(code, int) else code
    else:
        try:
            found = parse(name, result, output, args)
        except (ValueError, KeyError, json.JSONDecodeError) as problem:
            found["error"] = f"exit 0 but {problem}"
    expected = (args.steps, args.steps * args.batch_size * nodes)
    if "error" not in found and (found["steps"], found["samples"]) != expected:
        found["error"] = (f"timed {found['steps']} steps and {found['samples']} samples, not {expected[0]} "
                          f"and {expected[1]}")
    if "error" in found:  # its logs, to find out why
        shutil.copytree(cwd, args.out / "failed" / cwd.name, ignore=shutil.ignore_patterns("cache"))
    shutil.rmtree(cwd, ignore_errors=True)
    return found


def gradient_bytes(arch: str) -> int:
    """The bytes of one step's fp32 gradients: the trainable parameters of the model (1000 classes,
    as every contender builds it)."""
    from torchvision import models

    model = models.get_model(arch, weights=None, num_classes=1000)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


def summarize_rate(runs: dict[str, list[dict]], link_bytes: float, grad_bytes: int, batch: int) -> dict:
    """Per contender: medians, the scaling factor per round (paired: 2-node over 2 x the same round's
    1-node) and its median, the limit from its own 1-node step, and the share of it reached."""
    rows = {}
    for name, found in runs.items():
        ok = [r for r in found if "error" not in r["one"] and "error" not in r["two"]]
        errors = [f"round {r['round']}, {n} node{'s' if n == 2 else ''}: {r[key]['error']}"
                  for r in found for n, key in ((1, "one"), (2, "two")) if "error" in r[key]]
        row: dict = {"errors": errors, "rounds": len(ok)}
        if ok:
            factors = [r["two"]["images_per_sec"] / (2 * r["one"]["images_per_sec"]) for r in ok]
            one = statistics.median(r["one"]["images_per_sec"] for r in ok)
            step = batch / one  # one node's step time
            limit = scaling_limit(step, grad_bytes / (2 if name in FP16 else 1), link_bytes, 2)
            row.update(one_node=one, two_nodes=statistics.median(r["two"]["images_per_sec"] for r in ok),
                       factors=factors, factor=statistics.median(factors), step_seconds=step, limit=limit,
                       share=statistics.median(factors) / limit)
        rows[name] = row
    reference = next((n for n in (REFERENCE, *rows) if "step_seconds" in rows.get(n, {})), None)
    limits = {}
    if reference:
        step = rows[reference]["step_seconds"]
        limits = {"reference": reference, "step_seconds": step,
                  "fp32": scaling_limit(step, grad_bytes, link_bytes, 2),
                  "fp16": scaling_limit(step, grad_bytes / 2, link_bytes, 2)}
    return {"contenders": rows, "limit": limits}


def sweep_rate(harness: NetNodes, names: list[str], args: argparse.Namespace, grad_bytes: int, label: str) -> dict:
    """Every contender on 1 and 2 nodes, ``args.rounds`` times, in an order rotated every round."""
    link_mbit = min(harness.measured.values())
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in round_order(names, round_index):
            found = {"round": round_index + 1}
            for nodes, key in ((1, "one"), (2, "two")):
                args.port += 1  # a fresh rendezvous port for every torchrun job
                found[key] = run_once(name, nodes, args, harness, args.port)
                figure = found[key].get("images_per_sec")
                print(f"scaling: {label}, round {round_index + 1}/{args.rounds}, {name:<22} {nodes} node(s): "
                      + (f"{figure:8.2f} img/s" if "error" not in found[key] else f"FAILED: {found[key]['error']}")
                      + f" (load {load():.2f})", flush=True)
            runs[name].append(found)
    summary = summarize_rate(runs, link_mbit * 1e6 / 8, grad_bytes, args.batch_size)
    summary.update(rate=label, tbf=harness.state.get("rate"), measured_mbit=dict(harness.measured),
                   link_gbit=link_mbit / 1000, runs=runs)
    return summary


def markdown(results: dict) -> list[str]:
    """The results as Markdown: one table per rate, failures in one line each, the forecast check."""
    lines = [f"Settings: {results['settings_line']}. Gradients: {results['gradient_bytes'] / 1e6:.2f} MB fp32. "
             f"Load (1-min) {min(results['load']):.2f}..{max(results['load']):.2f}.", ""]
    for rate in results["rates"]:
        limit = rate["limit"]
        lines += [f"### Link {rate['rate']}: measured {rate['link_gbit'] * 1000:.0f} Mbit/s "
                  f"({', '.join(f'{k} {v:.0f}' for k, v in rate['measured_mbit'].items())})", ""]
        if limit:
            lines += [f"Limit at 2 nodes from {limit['reference']}'s 1-node step ({limit['step_seconds']:.3f} s): "
                      f"{limit['fp32']:.2f} fp32, {limit['fp16']:.2f} fp16.", ""]
        lines += ["| contender | 1 node img/s | 2 nodes img/s | scaling factor: median (per round) | "
                  "limit (own step) | share of the limit |", "| --- | --- | --- | --- | --- | --- |"]
        for name, row in rate["contenders"].items():
            if "factor" not in row:
                lines.append(f"| {name} | failed | | | | |")
                continue
            lines.append(f"| {name} | {row['one_node']:.2f} | {row['two_nodes']:.2f} | {row['factor']:.3f} "
                         f"({', '.join(f'{f:.3f}' for f in row['factors'])}) | {row['limit']:.3f} | "
                         f"{row['share']:.3f} |")
        failures = [f"- {name} failed at {rate['rate']}, {error}" for name, row in rate["contenders"].items()
                    for error in row["errors"]]
        lines += ["", *failures, *([""] if failures else [])]
    lines += ["### The forecast against the measurement (2 nodes)", "",
              "| link | contender | forecast (limit) | measured | measured / forecast | within +-10% |",
              "| --- | --- | --- | --- | --- | --- |"]
    for rate in results["rates"]:
        for name, row in rate["contenders"].items():
            if "factor" in row:
                lines.append(f"| {rate['rate']} | {name} | {row['limit']:.3f} | {row['factor']:.3f} | "
                             f"{row['share']:.3f} | {'yes' if abs(row['share'] - 1) <= 0.1 else 'no'} |")
    return lines


def chart(results: dict, path: Path) -> None:
    """Scaling factor against the measured link rate, one line per contender, the limits dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted(results["rates"], key=lambda rate: rate["link_gbit"])
    figure, axis = plt.subplots(figsize=(8, 5), dpi=80)
    for name in results["contenders"]:
        points = [(r["link_gbit"], r["contenders"][name]["factor"]) for r in rates
                  if "factor" in r["contenders"].get(name, {})]
        if points:
            axis.plot(*zip(*points), marker="o", label=name)
    steps = [r["limit"]["step_seconds"] for r in rates if r["limit"]]
    if steps:  # the limit as the function of the link it is, at the reference's median 1-node step
        low, high = rates[0]["link_gbit"], rates[-1]["link_gbit"]
        grid = [low * (high / low) ** (i / 99) for i in range(100)] if high > low else [low]
        for kind, style, share in (("fp32", "k--", 1), ("fp16", "k:", 2)):
            limits = [scaling_limit(statistics.median(steps), results["gradient_bytes"] / share, g * 1e9 / 8, 2)
                      for g in grid]
            axis.plot(grid, limits, style, label=f"limit, {kind} gradients ({limits[0]:.2f} at {low:.3g} Gbit/s)")
    axis.set_xscale("log")
    axis.set_xticks([r["link_gbit"] for r in rates], [f"{r['link_gbit']:.3g}" for r in rates])
    axis.minorticks_off()
    axis.set_xlabel("link rate, measured (Gbit/s)")
    axis.set_ylabel("scaling factor: 2-node img/s / (2 x 1-node img/s)")
    axis.set_ylim(0, 1.1)
    axis.set_title(results["settings_line"], fontsize=9)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def machine() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        return re.search(r"Model name:\s*(.+)", text).group(1).strip()
    except (OSError, AttributeError, subprocess.TimeoutExpired):
        return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--rates", default="0.25,1,4,unlimited", help="link rates in Gbit/s, comma-separated; "
                        "unlimited: the veth's own speed (default 0.25,1,4,unlimited)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--only", default=",".join(CONTENDERS), help="comma-separated contenders")
    parser.add_argument("--horovod-script", type=Path, default=horovod_script(),
                        help="Horovod's pytorch_synthetic_benchmark.py (default: shared/peers/horovod/ beside "
                             "the checkout)")
    parser.add_argument("--harness", type=Path, help="use two nodes already started (python -m "
                        "tests.multinode.netns start --dir DIR) at their rate; --rates is then ignored")
    parser.add_argument("--port", type=int, default=47100, help="first torchrun rendezvous port inside the nodes")
    parser.add_argument("--out", type=Path, default=Path("runs/scaling"))
    parser.add_argument("--timeout", type=int, default=600, help="seconds per run")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown or not names:
        raise SystemExit(f"scaling: unknown contender(s) {unknown} (choose from {', '.join(CONTENDERS)})")
    if args.rounds < 1 or args.steps < 1 or args.warmup_steps < 0:
        raise SystemExit("scaling: --rounds and --steps must be >= 1, --warmup-steps >= 0")
    rates = parse_rates(args.rates) if args.harness is None else []
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"scaling: {reason}")
    args.out.mkdir(parents=True, exist_ok=True)
    args.work = Path(tempfile.mkdtemp(prefix="hvdtrain-scaling-"))
    settings = (f"{args.arch} {args.image_size}px, batch {args.batch_size}/rank, 1 rank and 1 core per node, "
                f"{args.steps} timed steps after {args.warmup_steps}, {args.rounds} round(s)")
    print(f"scaling: {settings}; contenders {', '.join(names)}; load {load():.2f}", flush=True)
    results = {"settings": {k: str(v) for k, v in vars(args).items()}, "settings_line": settings,
               "contenders": names, "gradient_bytes": gradient_bytes(args.arch), "machine": machine(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": " ".join(sys.argv),
               "rates": [], "load": [load()]}
    start = time.perf_counter()
    try:
        if args.harness is not None:
            harness = NetNodes(args.harness)
            if not harness.state.get("sshd"):
                raise SystemExit(f"scaling: no nodes started in {args.harness} (python -m tests.multinode.netns "
                                 f"start --dir {args.harness})")
            results["rates"].append(sweep_rate(harness, names, args, results["gradient_bytes"],
                                               str(harness.state.get("rate") or "unlimited")))
        for index, rate in enumerate(rates):
            label = f"{rate:g} Gbit/s" if rate else "unlimited"
            harness = NetNodes(args.work / f"nodes{index}")
            harness.start(rate=f"{rate * 1000:g}mbit" if rate else None)
            try:
                print(f"scaling: link {label}: measured {harness.measured} Mbit/s", flush=True)
                results["rates"].append(sweep_rate(harness, names, args, results["gradient_bytes"], label))
            finally:
                harness.stop()
            results["load"].append(load())
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    results["seconds"] = time.perf_counter() - start
    results["load"].append(load())
    lines = markdown(results)
    print("\n".join(lines))
    (args.out / "scaling.json").write_text(json.dumps(results, indent=1) + "\n")
    (args.out / "scaling.md").write_text("\n".join(lines) + "\n")
    chart(results, args.out / "scaling.png")
    print(f"scaling: {results['seconds'] / 60:.1f} minutes; wrote {args.out / 'scaling.json'}, "
          f"{args.out / 'scaling.md'} and {args.out / 'scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
