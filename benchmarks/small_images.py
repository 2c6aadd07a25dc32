"""Small images from scratch, three contenders in one run on one split of scikit-learn's digits
(1,797 8x8 scans, 10 classes; a stratified 80/20 split written as a 32 px JPEG ImageFolder):

1. hvdtrain, 2 ranks (horovodrun --gloo), ``--config small_images`` (random crop of the 3 px padded
   image, no flips, cosine schedule, weight decay 5e-4, 20 epochs, global batch 64);
2. a plain PyTorch loop, one process (run at the same time as 1.), the same recipe written by hand with torchvision's
   ImageFolder, RandomCrop(32, padding=3) and the same model, batch, optimizer and schedule;
3. an RBF support-vector machine (scikit-learn SVC, default C and gamma) on the raw 8x8 pixels.

    python benchmarks/small_images.py [--epochs 20] [--work DIR]

Prints one line per contender and a JSON summary (validation top-1 of the last epoch, wall time).
Needs scikit-learn (the ``test`` extra).
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

import torch
import torch.nn.functional as F
from torchvision import datasets, models, transforms

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from hvdtrain.data.digits import digits_arrays, write_digits  # noqa: E402


def svm(seed: int) -> dict:
    from sklearn.svm import SVC

    start = time.perf_counter()
    train_x, train_y, val_x, val_y = digits_arrays(seed)
    model = SVC(kernel="rbf").fit(train_x.reshape(len(train_x), -1) / 255.0, train_y)
    top1 = 100.0 * (model.predict(val_x.reshape(len(val_x), -1) / 255.0) == val_y).mean()
    return {"top1": float(top1), "seconds": time.perf_counter() - start}


def plain_loop(data: Path, epochs: int, batch: int, lr: float, threads: int, seed: int) -> dict:
    """The recipe as a practitioner writes it: no hvdtrain code involved."""
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    normalize = transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    train_tf = transforms.Compose([transforms.Grayscale(3), transforms.RandomCrop(32, padding=3),
                                   transforms.ToTensor(), normalize])
    val_tf = transforms.Compose([transforms.Grayscale(3), transforms.ToTensor(), normalize])
    train_set = datasets.ImageFolder(str(data / "train"), train_tf)
    val_set = datasets.ImageFolder(str(data / "val"), val_tf)
    train = torch.utils.data.DataLoader(train_set, batch_size=batch, shuffle=True, drop_last=True)
    val = torch.utils.data.DataLoader(val_set, batch_size=256)
    model = models.resnet18(num_classes=10)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.SGD([{"params": decay, "weight_decay": 5e-4}, {"params": no_decay, "weight_decay": 0}],
                                lr=lr, momentum=0.9, nesterov=True)
    steps = epochs * len(train)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5 * (1 + math.cos(math.pi * s / steps)))
    start = time.perf_counter()
    top1 = 0.0
    for epoch in range(epochs):
        model.train()
        for images, labels in train:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
        model.eval()
        correct = 0
        with torch.no_grad():
            for images, labels in val:
                correct += int((model(images).argmax(1) == labels).sum())
        top1 = 100.0 * correct / len(val_set)
        print(f"plain loop: epoch {epoch + 1}/{epochs} val top1 {top1:.2f}%", flush=True)
    return {"top1": top1, "seconds": time.perf_counter() - start}


def start_hvdtrain(data: Path, out: Path, epochs: int, ranks: int) -> subprocess.Popen:
    python = Path(sys.executable)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [str(python.parent / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo",
           str(python), "-m", "hvdtrain", "--config", "small_images", f"data.dir={data}", f"output.dir={out}",
           f"train.epochs={epochs}", "runtime.threads=1", "checkpoint.resume=never", "output.progress=false"]
    return subprocess.Popen(cmd, env=env)


def finish_hvdtrain(job: subprocess.Popen, out: Path, start: float) -> dict:
    if job.wait() != 0:
        raise SystemExit(f"hvdtrain exited {job.returncode}")
    seconds = time.perf_counter() - start
    val = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [m for m in val if m["split"] == "val"]
    return {"top1": val[-1]["top1"], "best_top1": max(m["top1"] for m in val), "epochs": len(val),
            "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--work", default="", help="folder for the dataset and the run (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="hvdtrain-small-images-"))
    data = write_digits(work / "digits32", size=32, seed=args.seed)
    results = {"svm": svm(args.seed)}
    print(f"SVM (rbf, raw 8x8 pixels): val top1 {results['svm']['top1']:.2f}%", flush=True)
    # hvdtrain's ranks and the plain loop run at the same time (one thread each): the comparison is
    # of accuracy; their wall times on a shared machine are only indicative.
    start = time.perf_counter()
    job = start_hvdtrain(data, work / "hvdtrain-run", args.epochs, args.ranks)
    # The plain loop: global batch 64 and lr 0.05, as small_images on 2 ranks (0.2 per 256 x 64/256).
    results["plain_pytorch"] = plain_loop(data, args.epochs, 32 * args.ranks, 0.2 * 32 * args.ranks / 256,
                                          threads=1, seed=args.seed)
    print(f"plain PyTorch loop: val top1 {results['plain_pytorch']['top1']:.2f}% "
          f"in {results['plain_pytorch']['seconds']:.0f}s", flush=True)
    results["hvdtrain"] = finish_hvdtrain(job, work / "hvdtrain-run", start)
    print(f"hvdtrain {args.ranks} ranks --config small_images: val top1 {results['hvdtrain']['top1']:.2f}% "
          f"in {results['hvdtrain']['seconds']:.0f}s", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
