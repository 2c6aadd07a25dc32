"""Quality parity with pytorch/examples' imagenet/main.py: the same recipe, two implementations, the same
small real data set, seed by seed, the validation accuracy of every epoch side by side.

1. DDP: benchmarks/ddp_main_py.py, main.py's recipe in main.py's shape (torchvision transforms, DDP,
   StepLR), under ``torchrun --standalone --nproc-per-node RANKS``;
2. hvdtrain: ``--config pytorch_examples`` under ``horovodrun -np RANKS --gloo``, with the same
   overrides (size, epochs, global batch, rate, step, seed, workers).

The data: scikit-learn's digits (1,797 8x8 scans, 10 classes) as a 32 px JPEG ImageFolder,
stratified 80/20 (hvdtrain/data/digits.py: 1,437 training and 360 validation images). Each seed
seeds both the model's initialization and the sampler's order (seed + epoch) on both sides; the
contenders alternate which runs first from seed to seed.

    nice -n 10 python benchmarks/pytorch_examples_parity.py [--seeds 0 1] [--epochs 15] [--lr 0.02]
        [--step-every 10] [--batch-size 64] [--ranks 2] [--work DIR] [--json FILE]

Prints one line per run, then the two accuracy curves side by side for each seed, and the last
epoch's validation top-1 of each contender with its mean and spread over the seeds. Needs
scikit-learn (the ``test`` extra) and torchrun (PyTorch's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hvdtrain.data.digits import write_digits  # noqa: E402

BIN = Path(sys.executable).parent
CONTENDERS = ("ddp", "hvdtrain")


def job_env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "HVDTRAIN_CACHE": str(work / "cache"), "OMPI_ALLOW_RUN_AS_ROOT": "1",
            "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def run_ddp(args, data: Path, seed: int, out: Path) -> list[dict]:
    out.unlink(missing_ok=True)
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(args.ranks),
               str(REPO / "benchmarks" / "ddp_main_py.py"), str(data), "--image-size", str(args.image_size),
               "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
               "--step-every", str(args.step_every), "--seed", str(seed), "--workers", str(args.workers),
               "--out", str(out)]
    done = subprocess.run(command, cwd=out.parent, env=job_env(out.parent), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"DDP run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in out.read_text().splitlines()]


def run_hvdtrain(args, data: Path, seed: int, out: Path) -> list[dict]:
    command = [str(BIN / "horovodrun"), "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
               str(BIN / "python"), "-m", "hvdtrain", "--config", "pytorch_examples", f"data.dir={data}",
               f"data.image_size={args.image_size}", f"train.epochs={args.epochs}",
               f"train.global_batch_size={args.batch_size}", f"optim.lr={args.lr}",
               f"optim.step_every_epochs={args.step_every}", f"seed={seed}", f"data.workers={args.workers}",
               "runtime.threads=1", "output.progress=false", "tracking.every_steps=0", f"output.dir={out}",
               "checkpoint.resume=never"]
    done = subprocess.run(command, cwd=out.parent, env=job_env(out.parent), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"hvdtrain run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = {r["epoch"]: r for r in records if r["split"] == "train"}
    val = {r["epoch"]: r for r in records if r["split"] == "val"}
    steps = [train[e]["step"] - (train[e - 1]["step"] if e else 0) for e in sorted(train)]
    return [{"epoch": e, "train_loss": train[e]["loss"], "train_samples": train[e]["samples"], "steps": steps[e],
             "val_loss": val[e]["loss"], "val_top1": val[e]["top1"], "val_samples": val[e]["samples"],
             "lr": train[e]["lr"], "seconds": train[e]["seconds"] + val[e]["seconds"]} for e in sorted(val)]


def spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}"
    return (f"mean {statistics.mean(values):.2f}, range {min(values):.2f}-{max(values):.2f}, "
            f"sd {statistics.stdev(values):.2f}")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.02, help="main.py's --lr, as given on both sides")
    parser.add_argument("--step-every", type=int, default=10, help="StepLR's step_size (main.py: 30)")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch (main.py's -b)")
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="loader workers per process, both sides")
    parser.add_argument("--work", type=Path, default=None,
                        help="folder for the data and the runs (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None, help="write the curves and the summary here too")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="pytorch-examples-parity-"))
    work.mkdir(parents=True, exist_ok=True)
    data = write_digits(work / "digits32", 32)
    curves: dict[str, dict[int, list[dict]]] = {name: {} for name in CONTENDERS}
    walls: dict[str, dict[int, float]] = {name: {} for name in CONTENDERS}
    for index, seed in enumerate(args.seeds):
        order = CONTENDERS if index % 2 == 0 else CONTENDERS[::-1]  # alternate who runs first
        for name in order:
            start = time.perf_counter()
            out = work / f"{name}-seed{seed}"
            out.mkdir(exist_ok=True)
            if name == "ddp":
                curves[name][seed] = run_ddp(args, data, seed, out / "epochs.jsonl")
            else:
                curves[name][seed] = run_hvdtrain(args, data, seed, out / "run")
            walls[name][seed] = time.perf_counter() - start
            last = curves[name][seed][-1]
            print(f"{name:8s} seed {seed}: val top-1 {last['val_top1']:.2f}% after {len(curves[name][seed])} epochs, "
                  f"{walls[name][seed]:.0f} s wall", flush=True)
    print("\nvalidation top-1 (%) by epoch, DDP | hvdtrain:")
    print("epoch  " + "  ".join(f"seed {seed}: DDP | hvdtrain" for seed in args.seeds))
    for epoch in range(args.epochs):
        cells = [f"        {curves['ddp'][s][epoch]['val_top1']:6.2f} | {curves['hvdtrain'][s][epoch]['val_top1']:6.2f}"
                 for s in args.seeds]
        print(f"{epoch + 1:5d}  " + "  ".join(cells))
    final = {name: [curves[name][s][-1]["val_top1"] for s in args.seeds] for name in CONTENDERS}
    summary = {name: {"final_top1": final[name], "mean": statistics.mean(final[name]),
                      "wall_seconds": [walls[name][s] for s in args.seeds]} for name in CONTENDERS}
    print(f"\nlast epoch, over seeds {args.seeds}:")
    for name in CONTENDERS:
        print(f"  {name:8s} {spread(final[name])}; wall {spread(summary[name]['wall_seconds'])} s")
    print("  hvdtrain - DDP, seed by seed: "
          + ", ".join(f"{h - d:+.2f}" for h, d in zip(final["hvdtrain"], final["ddp"])))
    result = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "curves": {name: {str(s): curves[name][s] for s in args.seeds} for name in CONTENDERS},
              "summary": summary}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
