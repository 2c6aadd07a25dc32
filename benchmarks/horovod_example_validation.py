"""Why Horovod's example and hvdtrain report different validation numbers for the same weights.

1. Horovod's own examples/pytorch/pytorch_imagenet_resnet50.py, run unchanged from
   ../shared/peers/horovod/ under ``horovodrun -np RANKS --gloo`` (``--no-cuda``), on a small
   ImageFolder with an odd number of validation images; its TensorBoard ``val/accuracy`` and
   ``val/loss`` of each epoch, and its ``checkpoint-{epoch}.pth.tar``.
2. ``hvdtrain evaluate --checkpoint checkpoint-{epoch}.pth.tar`` of each of those files, on RANKS
   ranks: every image counted once, the model as the file holds it (rank 0's BatchNorm statistics).
3. The example's validation recomputed in one process from the same file, to split the difference:
   its transforms (Pillow + torchvision), its padded DistributedSampler shares and its mean of
   per-batch means (``example``), and the same images each counted once (``each once``), both with
   the file's (rank 0's) BatchNorm statistics. The example's logged number differs from ``example``
   only by the other ranks' own BatchNorm statistics; ``each once`` differs from hvdtrain's only by
   the JPEG decoding.
4. hvdtrain's own run of ``--config horovod_example`` on the same data, for its curve beside the
   example's (other random draws: not the same weights).

    nice -n 10 python benchmarks/horovod_example_validation.py [--epochs 2] [--ranks 2] [--work DIR] [--json FILE]

Prints one line per epoch and contender and a JSON summary; needs the copy of the example in
../shared/peers/horovod/ (beside the checkout or a folder above it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BIN = Path(sys.executable).parent


def example_source() -> Path:
    for folder in REPO.parents:
        path = folder / "shared" / "peers" / "horovod" / "pytorch_imagenet_resnet50.py"
        if path.is_file():
            return path
    raise SystemExit("no copy of Horovod's pytorch_imagenet_resnet50.py in ../shared/peers/horovod")


def job_env(work: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "HVDTRAIN_CACHE": str(work / "cache")}


def run(command: list[str], work: Path, what: str) -> subprocess.CompletedProcess:
    started = time.perf_counter()
    done = subprocess.run(command, cwd=work, env=job_env(work), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{what} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    print(f"{what}: {time.perf_counter() - started:.0f} s", flush=True)
    return done


def make_data(root: Path, train_per_class: int, val_per_class: int) -> None:
    """4 classes of the demo's shapes at 40 px, and one more validation image: an odd count, so that
    the example's DistributedSampler repeats one and its last batches are short."""
    import numpy as np

    from hvdtrain.data.demo import draw, generate

    generate(root, train_per_class=train_per_class, val_per_class=val_per_class, size=40, num_classes=4)
    draw(0, 40, np.random.default_rng(99)).save(root / "val" / "horizontal_0" / "extra.JPEG", quality=90)


def example_scalars(logs: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logs), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def recompute(checkpoint: Path, val_dir: Path, ranks: int, batch: int) -> dict[str, float]:
    """The example's validate() from the file, in one process, with the file's BatchNorm statistics
    for every rank's share: ``example`` (its sampler, batches and mean of per-batch means) and
    ``each once`` (every image once, means over images)."""
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler
    from torchvision import datasets, models, transforms

    model = models.resnet50()  # the example's: 1000 classes whatever the data has
    model.load_state_dict(torch.load(checkpoint, weights_only=True)["model"])
    model.eval()
    dataset = datasets.ImageFolder(str(val_dir), transform=transforms.Compose([
        transforms.Resize(256), transforms.CenterCrop(224), transforms.ToTensor(),
        transforms.Normalize(mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225])]))
    batch_means = {"loss": [], "accuracy": []}
    with torch.no_grad():
        for rank in range(ranks):
            sampler = DistributedSampler(dataset, num_replicas=ranks, rank=rank)
            for data, target in DataLoader(dataset, batch_size=batch, sampler=sampler):
                output = model(data)
                batch_means["loss"].append(float(F.cross_entropy(output, target)))
                batch_means["accuracy"].append(float(output.argmax(1).eq(target).float().mean()))
        data = torch.stack([dataset[i][0] for i in range(len(dataset))])
        target = torch.tensor([dataset[i][1] for i in range(len(dataset))])
        output = model(data)
    # The example's Metric: the per-batch values of every rank averaged, batch by batch (ranks have
    # equal batch counts), then over batches: the mean of all per-batch means.
    return {"example_loss": sum(batch_means["loss"]) / len(batch_means["loss"]),
            "example_accuracy": sum(batch_means["accuracy"]) / len(batch_means["accuracy"]),
            "each_once_loss": float(F.cross_entropy(output, target)),
            "each_once_accuracy": float(output.argmax(1).eq(target).float().mean()),
            "images": len(dataset), "batches": len(batch_means["loss"])}


def json_line(stdout: str) -> dict:
    line = [text for text in stdout.splitlines() if '{"' in text][-1]
    return json.loads(line[line.index("{"):])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--train-per-class", type=int, default=16)
    parser.add_argument("--val-per-class", type=int, default=5)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="hvd-example-val-"))
    work.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    if not data.exists():
        make_data(data, args.train_per_class, args.val_per_class)
    launcher = [str(BIN / "horovodrun"), "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo"]
    run(launcher + [str(BIN / "python"), str(example_source()), "--train-dir", str(data / "train"),
                    "--val-dir", str(data / "val"), "--log-dir", str(work / "logs"),
                    "--checkpoint-format", str(work / "checkpoint-{epoch}.pth.tar"), "--no-cuda",
                    "--epochs", str(args.epochs), "--batch-size", str(args.batch_size),
                    "--val-batch-size", str(args.batch_size), "--warmup-epochs", "1"], work, "the example")
    logged = example_scalars(work / "logs")
    small = ["data.workers=0", "runtime.threads=1", "output.progress=false"]
    rows = []
    for epoch in range(1, args.epochs + 1):
        checkpoint = work / f"checkpoint-{epoch}.pth.tar"
        scored = json_line(run(launcher + [str(BIN / "python"), "-m", "hvdtrain", "evaluate", "--checkpoint",
                                           str(checkpoint), f"data.dir={data}", "model.num_classes=1000", *small],
                                   work,
                               f"hvdtrain evaluate checkpoint-{epoch}").stdout)
        row = {"epoch": epoch, "example_logged_accuracy": logged["val/accuracy"][epoch - 1],
               "example_logged_loss": logged["val/loss"][epoch - 1],
               **recompute(checkpoint, data / "val", args.ranks, args.batch_size),
               "hvdtrain_top1": scored["top1"] / 100, "hvdtrain_loss": scored["loss"],
               "hvdtrain_samples": scored["samples"]}
        rows.append(row)
        print(f"epoch {epoch}: val accuracy: example logged {row['example_logged_accuracy']:.4f}, recomputed with "
              f"rank 0's BatchNorm {row['example_accuracy']:.4f}, each image once {row['each_once_accuracy']:.4f}, "
              f"hvdtrain evaluate {row['hvdtrain_top1']:.4f} ({row['hvdtrain_samples']} images); val loss: "
              f"{row['example_logged_loss']:.4f}, {row['example_loss']:.4f}, {row['each_once_loss']:.4f}, "
              f"{row['hvdtrain_loss']:.4f}", flush=True)
    own = work / "hvdtrain-run"
    run(launcher + [str(BIN / "python"), "-m", "hvdtrain", "--config", "horovod_example", f"data.dir={data}",
                    f"train.epochs={args.epochs}", f"train.batch_size={args.batch_size}", "optim.warmup_epochs=1",
                    f"output.dir={own}", "checkpoint.resume=never", "tracking.every_steps=0", *small], work,
        "hvdtrain --config horovod_example")
    records = [json.loads(line) for line in (own / "metrics.jsonl").read_text().splitlines()]
    curve = [{"epoch": r["epoch"] + 1, "val_top1": r["top1"] / 100, "val_loss": r["loss"], "samples": r["samples"]}
             for r in records if r.get("split") == "val"]
    for point in curve:
        print(f"hvdtrain's own run, epoch {point['epoch']}: val accuracy {point['val_top1']:.4f}, loss "
              f"{point['val_loss']:.4f} ({point['samples']} images)", flush=True)
    summary = {"ranks": args.ranks, "epochs": args.epochs, "batch_size": args.batch_size, "same_weights": rows,
               "hvdtrain_run": curve, "finite": all(math.isfinite(r["hvdtrain_loss"]) for r in rows)}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
