"""The DDP digits script against its two hvdtrain ports: whole processes, start-up included, alternated.

    python benchmarks/ddp_port.py --pairs 5                 # 10 epochs, global batch 64, 2 CPU ranks

Contenders (examples/from_ddp; the same model, data, optimizer, batch and epochs):
  ddp        torchrun --standalone --nproc-per-node 2 ddp_digits.py
  hvdtrain   horovodrun -np 2 -H localhost:2 --gloo python hvdtrain_digits.py (--controller mpi: --mpi)
  own-loop   horovodrun -np 2 -H localhost:2 --gloo python own_loop_digits.py (the DDP script's own
             loop on hvdtrain.distributed)

Each pair runs every contender, in an order that rotates from pair to pair, each in a fresh folder
(no snapshot or checkpoint to resume from). The wall time of a contender is its launcher's whole run:
interpreter start-up, imports, process group / Horovod start, data, training, validation and
checkpoints. Printed: every pair, the medians and each port's ratio to ddp (the issue's target:
at most 1.10), and the work each did (epochs seen in its output, validation accuracy), so that a
fast run that did less is seen. Results go to OUT/ddp_port.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "from_ddp"
BIN = Path(sys.executable).parent
CONTENDERS = ("ddp", "hvdtrain", "own-loop")


def commands(args: argparse.Namespace, folder: Path) -> dict[str, list[str]]:
    common = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size)]
    return {
        "ddp": [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(EXAMPLE / "ddp_digits.py"),
                *common, "--snapshot", str(folder / "snapshot.pt")],
        "hvdtrain": [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", f"--{args.controller}",
                     str(BIN / "python"), str(EXAMPLE / "hvdtrain_digits.py"), *common, "--out", str(folder / "run")],
        "own-loop": [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", f"--{args.controller}",
                     str(BIN / "python"), str(EXAMPLE / "own_loop_digits.py"), *common, "--snapshot",
                     str(folder / "snapshot.pt")],
    }


def work_done(name: str, output: str, folder: Path) -> dict[str, float]:
    """Epochs and the last validation accuracy, from what the contender printed (hvdtrain: its
    metrics.jsonl too, with the samples trained)."""
    if name in ("ddp", "own-loop"):  # the same lines (horovodrun puts its rank tag before them)
        found = re.findall(r"epoch (\d+) \| val loss [0-9.]+ \| val accuracy ([0-9.]+)%$", output, re.M)
        return {"epochs": len(found), "val_accuracy": float(found[-1][1]) if found else float("nan")}
    path = folder / "run" / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    train = [r for r in records if r.get("split") == "train"]
    val = [r for r in records if r.get("split") == "val"]
    return {"epochs": len(train), "val_accuracy": val[-1]["accuracy"] if val else float("nan"),
            "train_samples": sum(r.get("samples", 0) for r in train)}


def run_one(name: str, command: list[str], folder: Path, env: dict[str, str]) -> dict[str, float]:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{name} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return {"seconds": seconds, **work_done(name, result.stdout + result.stderr, folder)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"which to run, comma-separated (ddp always): {', '.join(CONTENDERS)}")
    parser.add_argument("--controller", choices=("gloo", "mpi"), default="gloo",
                        help="Horovod's controller for hvdtrain (horovodrun picks mpi where Open MPI is installed)")
    args = parser.parse_args(argv)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    names = ["ddp"] + [name for name in CONTENDERS[1:] if name in args.contenders.split(",")]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="ddp_port_") as scratch:
        for pair in range(args.pairs):
            order = names[pair % len(names):] + names[:pair % len(names)]
            line = []
            for name in order:
                folder = Path(scratch) / f"{name}-{pair}"
                folder.mkdir()
                result = run_one(name, commands(args, folder)[name], folder, env)
                runs[name].append(result)
                line.append(f"{name} {result['seconds']:.2f} s ({result['epochs']} epochs, "
                            f"val accuracy {result['val_accuracy']:.2f}%)")
            print(f"pair {pair + 1}/{args.pairs}: " + ", ".join(line), flush=True)
    median = {name: statistics.median(r["seconds"] for r in results) for name, results in runs.items()}
    ratios = {name: sorted(mine["seconds"] / ddp["seconds"] for mine, ddp in zip(runs[name], runs["ddp"]))
              for name in names[1:]}
    summary = {"pairs": args.pairs, "epochs": args.epochs, "global_batch": args.batch_size,
               "controller": args.controller, "load_average": os.getloadavg(), "median_seconds": median,
               "ratio_of_medians": {name: median[name] / median["ddp"] for name in names[1:]},
               "pair_ratios": ratios, "runs": runs}
    print("median wall time: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in median.items()))
    for name in names[1:]:
        print(f"{name} / ddp = {summary['ratio_of_medians'][name]:.3f} (pairs: {ratios[name][0]:.3f}-"
              f"{ratios[name][-1]:.3f}; target <= 1.10)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ddp_port.json").write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
