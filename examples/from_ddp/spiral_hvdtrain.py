"""After: ddp_train.py's training on hvdtrain (README.md explains every change).

    horovodrun -np 2 python spiral_hvdtrain.py 4 [key=value ...]
    mpirun -np 2 -bind-to none -map-by slot python spiral_hvdtrain.py 4
    srun --mpi=pmix -n 2 python spiral_hvdtrain.py 4

The same dataset, model, optimizer, learning-rate schedule and sample order; hvdtrain adds exact
resume (mid-epoch too), SIGTERM checkpoints, validation summed exactly over ranks, the watchdog,
metrics.jsonl and elastic mode.
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import hvdtrain


class Spirals(Dataset):
    """3 spiral arms in the plane, 2 coordinates -> the arm; generated from a fixed seed."""

    def __init__(self, size: int, seed: int = 7):
        generator = torch.Generator().manual_seed(seed)
        label = torch.arange(size) % 3
        radius = torch.rand(size, generator=generator)
        angle = label * (2 * math.pi / 3) + 4 * radius + 0.2 * torch.randn(size, generator=generator)
        self.points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
        self.label = label

    def __len__(self):
        return len(self.label)

    def __getitem__(self, key):
        index, _seed = key  # ShardedSampler yields (index, augmentation seed); nothing random here
        return self.points[index], self.label[index]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 3))


class SpiralTask(hvdtrain.Task):
    name = "spirals"
    sum_fields = ("loss_sum", "correct", "count")
    best_metric = "accuracy"
    higher_is_better = True

    def build_loaders(self, env):
        train_set, val_set = Spirals(2048), Spirals(300, seed=8)
        train_sampler = hvdtrain.ShardedSampler(len(train_set), env.world_size, env.rank, seed=self.cfg.seed)
        val_sampler = hvdtrain.ShardedSampler(len(val_set), env.world_size, env.rank, shuffle=False, pad=False)
        kwargs = hvdtrain.loader_kwargs(self.cfg.data, env.pin_memory)
        batch = self.cfg.train.batch_size
        train = DataLoader(train_set, batch_size=batch, sampler=train_sampler, drop_last=not env.keep_partial_batches,
                           generator=torch.Generator().manual_seed(self.cfg.seed), **kwargs)
        val = DataLoader(val_set, batch_size=batch, sampler=val_sampler, **kwargs)
        return hvdtrain.Loaders(train, val, train_sampler, len(train_set), len(val_set), val_sampler)

    def build_model(self):
        return make_model()

    def to_device(self, batch, device, dtype):
        points, label = batch
        return points.to(device, dtype), label.to(device)

    def loss(self, outputs, targets, training):
        return F.cross_entropy(outputs, targets)

    def metric_sums(self, loss, outputs, targets):
        count = torch.tensor(float(len(targets)), dtype=torch.float64, device=targets.device)
        return torch.stack([loss.double() * count, (outputs.argmax(1) == targets).sum().double(), count])

    def summarize(self, sums):
        loss_sum, correct, count = sums.tolist()
        return {"loss": loss_sum / count, "accuracy": 100 * correct / count, "samples": int(count)}


if __name__ == "__main__":  # loader workers (forkserver) import this file: train only when run
    parser = argparse.ArgumentParser(description="simple distributed training job, on hvdtrain")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each rank (default: 32)")
    parser.add_argument("--base_lr", default=0.2, type=float,
                        help="Learning rate per 256 samples, scaled by the global batch (default: 0.2, which is "
                        "0.05 at 2 ranks x 32)")
    parser.add_argument("overrides", nargs="*", help="hvdtrain config overrides, key=value")
    args = parser.parse_args()
    hvdtrain.fit(SpiralTask, {
        "seed": 0,
        "train": {"epochs": args.total_epochs, "batch_size": args.batch_size},
        "optim": {"base_lr": args.base_lr, "momentum": 0.9, "nesterov": False,
                  "weight_decay": 0.0, "warmup_epochs": 0, "schedule": "cosine"},
        "data": {"workers": 0},
        "output": {"dir": "runs/spirals"},
    }, overrides=args.overrides)
