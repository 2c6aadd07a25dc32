"""Real JPEGs against the GPU, side by side, in one run (one lent-machine call of at most 10 minutes):

1. writes an ImageNet-like folder: photo-like 500x375 JPEGs at quality 90 (``--unique`` of them,
   hard-linked up to ``--images``, enough for a few hundred steps: decoding costs the same for a
   file and its link, and the page cache holds the few unique ones);
2. measures, one after the other: the raw PyTorch loop on synthetic data (benchmarks/torch_loop.py),
   ``hvdtrain bench`` on synthetic data, a synthetic-data epoch of the trainer (the prefetch's
   effect), an epoch through the CPU pipeline at each of ``--workers`` loader workers, and an epoch
   through GPU decoding (``data.decoder=nvimgcodec``);
3. samples ``nvidia-smi`` utilization every 0.2 s during each, and takes each run's CPU time
   (training process and loader workers, from the kernel's accounting of finished children).

Prints one row per contender: images/s (the epoch's own, from metrics.jsonl), its ratio to the raw
loop, the median GPU utilization after the first 20% of the run, the CPU cores it kept busy and
the cores it would need to feed the raw loop's rate at its rate per core (cores busy: the trainer's
own CPU sampling during the epoch, training process plus loader workers; for the raw loop and the
bench, the whole run's CPU time over its wall time); then the runs as JSON.

    python benchmarks/gpu/input_pipeline.py --out gpu-results                  # one H100: ResNet-50, AMP, batch 256
    # the same plumbing on a CPU (tests)
    python benchmarks/gpu/input_pipeline.py --device cpu --arch resnet18 --image-size 32 --batch-size 8 \\
        --images 64 --unique 8 --workers 1 --steps 4 --warmup-steps 1 --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))


def write_one(args: tuple[Path, int]) -> None:
    import numpy as np

    from hvdtrain.tools.bench_data import photo

    path, seed = args
    photo(np.random.default_rng(seed)).save(path, quality=90)


def make_folder(root: Path, images: int, unique: int, val: int, classes: int = 100) -> None:
    """train/ with ``images`` files (``unique`` distinct photos, the rest hard links), val/ with ``val``;
    both splits hold the same classes (at most ``val``)."""
    if (root / "val").is_dir():
        return
    classes = min(classes, val)
    originals = root / "originals"
    originals.mkdir(parents=True, exist_ok=True)
    sources = [originals / f"photo_{i:05d}.JPEG" for i in range(unique)]
    with ProcessPoolExecutor() as pool:
        list(pool.map(write_one, [(path, seed) for seed, path in enumerate(sources)], chunksize=16))
    for split, count in (("train", images), ("val", val)):
        for i in range(count):
            folder = root / split / f"class_{i % classes:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            os.link(sources[(i * 7919) % unique], folder / f"img_{i:07d}.JPEG")


class Utilization:
    """nvidia-smi's GPU utilization every 0.2 s while a run lasts (empty without nvidia-smi)."""

    def __init__(self):
        self.samples: list[float] = []
        self.process = None
        if shutil.which("nvidia-smi"):
            self.process = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu",
                                             "--format=csv,noheader,nounits", "-lms", "200"],
                                            stdout=subprocess.PIPE, text=True)
            self.thread = threading.Thread(target=self.read, daemon=True)
            self.thread.start()

    def read(self) -> None:
        for line in self.process.stdout:
            try:
                self.samples.append(float(line.split(",")[0]))
            except ValueError:
                pass

    def stop(self) -> dict:
        if self.process is None:
            return {"samples": 0}
        self.process.terminate()
        self.process.wait()
        steady = self.samples[len(self.samples) // 5:] or self.samples
        return {"samples": len(self.samples), "median_after_warmup": statistics.median(steady) if steady else None,
                "at_least_95": sum(u >= 95 for u in steady) / max(1, len(steady))}


def run(name: str, command: list[str], env: dict, timeout: int) -> dict:
    """One contender: wall time, CPU time of the process tree, GPU utilization, its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    util = Utilization()
    start = time.perf_counter()
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    result = {"name": name, "exit": done.returncode, "wall_seconds": wall, "cpu_seconds": cpu,
              "cores_busy": cpu / wall, "gpu_utilization": util.stop(), "command": command}
    if done.returncode != 0:
        result["log"] = (done.stdout + done.stderr)[-3000:]
    result["output"] = done.stdout
    return result


def epoch_rate(run_dir: Path) -> dict:
    """The trained epoch's own images/s, steps and samples (metrics.jsonl)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"][-1]
    found = {"images_per_sec": train["samples_per_sec"], "samples": train["samples"],
             "steps": train["step"],  # one epoch from scratch: its global step count
             "data_wait_fraction": train["data_wait_fraction"]}
    if train.get("cpu_percent") is not None:
        # The trainer's own sampling during the epoch's training: the training process and its
        # loader workers (start-up and validation left out, unlike the whole run's CPU time).
        found["cores_busy_training"] = (train["cpu_percent"] + (train.get("workers_cpu_percent") or 0)) / 100
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="gpu-results")
    parser.add_argument("--data", default="", help="the ImageNet-like folder (default: OUT/jpegs)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--arch", default="resnet50")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--steps", type=int, default=150, help="training steps per epoch run")
    parser.add_argument("--warmup-steps", type=int, default=10, help="untimed steps of the raw loop and the bench")
    parser.add_argument("--images", type=int, default=0, help="train files (default: steps x batch)")
    parser.add_argument("--unique", type=int, default=2000, help="distinct photos among them")
    parser.add_argument("--workers", default="4,8,16", help="loader workers of the CPU-pipeline runs")
    parser.add_argument("--gpu-workers", type=int, default=4, help="loader workers of the GPU-decoding run")
    parser.add_argument("--timeout", type=int, default=400, help="seconds per run")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve() if args.data else out / "jpegs"
    images = args.images or args.steps * args.batch_size
    started = time.perf_counter()
    make_folder(data, images, min(args.unique, images), val=max(args.batch_size, images // 50))
    print(f"input_pipeline: {images} train JPEGs ({min(args.unique, images)} distinct) in "
          f"{time.perf_counter() - started:.0f} s at {data}", flush=True)
    python = sys.executable
    gpu = args.device == "cuda"
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    common = [f"model.arch={args.arch}", f"train.batch_size={args.batch_size}", f"data.image_size={args.image_size}",
              f"runtime.device={args.device}", "checkpoint.resume=never", "output.progress=false",
              "output.tensorboard=false", "train.epochs=1", "optim.warmup_epochs=0"] + \
        (["amp.enabled=true"] if gpu else ["runtime.threads=1"])
    loop = [python, str(REPO / "benchmarks" / "torch_loop.py"), "--arch", args.arch, "--batch-size",
            str(args.batch_size), "--image-size", str(args.image_size), "--warmup-steps", str(args.warmup_steps),
            "--steps", str(args.steps), "--json", str(out / "raw.json")] + (["--amp", "--channels-last"] if gpu else [])
    bench = [python, "-m", "hvdtrain", "bench", "--warmup-steps", str(args.warmup_steps), "--steps", str(args.steps),
             "--repeats", "1", "--json", str(out / "bench.json")]
    bench += [c for c in common if not c.startswith(("checkpoint", "output", "train.epochs"))]
    contenders: list[tuple[str, list[str], Path | None]] = [("raw loop, synthetic", loop, None),
                                                             ("hvdtrain bench, synthetic", bench, None)]
    synthetic = out / "run-synthetic"
    contenders.append(("epoch, synthetic data", [python, "-m", "hvdtrain", *common, "data.synthetic=true",
                                                 f"data.synthetic_samples={images}", f"output.dir={synthetic}",
                                                 f"train.steps_per_epoch={args.steps}"], synthetic))
    for workers in [int(w) for w in args.workers.split(",") if w]:
        run_dir = out / f"run-cpu-{workers}"
        contenders.append((f"epoch, JPEGs, CPU decoding, {workers} workers",
                           [python, "-m", "hvdtrain", *common, f"data.dir={data}", "data.decoder=cpu",
                            f"data.workers={workers}", f"output.dir={run_dir}", f"train.steps_per_epoch={args.steps}"],
                           run_dir))
    run_dir = out / "run-gpu-decode"
    contenders.append((f"epoch, JPEGs, nvimgcodec, {args.gpu_workers} workers",
                       [python, "-m", "hvdtrain", *common, f"data.dir={data}", "data.decoder=nvimgcodec",
                        f"data.workers={args.gpu_workers}", f"output.dir={run_dir}",
                        f"train.steps_per_epoch={args.steps}"], run_dir))
    results = []
    for name, command, run_dir in contenders:
        if run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        result = run(name, command, env, args.timeout)
        if result["exit"] == 0:
            if run_dir is not None:
                result.update(epoch_rate(run_dir))
            else:
                found = [line for line in result["output"].splitlines() if "images_per_sec=" in line]
                result["images_per_sec"] = float(found[-1].split("images_per_sec=")[1].split()[0])
                result["steps"] = args.steps
        results.append(result)
        print(f"{name}: " + (f"{result['images_per_sec']:.1f} img/s" if "images_per_sec" in result else
                             f"FAILED (exit {result['exit']})\n{result.get('log', '')}"), flush=True)
    raw = results[0].get("images_per_sec") or float("nan")
    print(f"\n{'contender':<42} {'img/s':>8} {'of raw':>7} {'GPU util':>9} {'cores busy':>10} "
          f"{'cores to feed raw':>17}")
    for result in results:
        if "images_per_sec" not in result:
            print(f"{result['name']:<42} failed")
            continue
        util = result["gpu_utilization"].get("median_after_warmup")
        cores = result.get("cores_busy_training", result["cores_busy"])
        per_core = result["images_per_sec"] / max(cores, 1e-9)
        result["cores_to_feed_raw"] = raw / per_core
        print(f"{result['name']:<42} {result['images_per_sec']:>8.1f} {result['images_per_sec'] / raw:>7.3f} "
              f"{(f'{util:.0f}%' if util is not None else 'n/a'):>9} {cores:>10.2f} "
              f"{result['cores_to_feed_raw']:>17.2f}")
    for result in results:
        result.pop("output", None)
    (out / "input_pipeline.json").write_text(json.dumps(results, indent=1) + "\n")
    print(f"input_pipeline: {len(results)} runs in {time.perf_counter() - started:.0f} s; "
          f"{out / 'input_pipeline.json'}")
    print(json.dumps([{k: r.get(k) for k in ("name", "images_per_sec", "steps", "samples", "exit")} for r in results]))
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
