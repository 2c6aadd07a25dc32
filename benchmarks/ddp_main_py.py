"""A DDP script with pytorch/examples' imagenet/main.py recipe (read at pytorch/examples@4206858), written
here in main.py's shape (main.py itself is not vendored), for benchmarks/pytorch_examples_parity.py:

    torchrun --standalone --nproc-per-node 2 benchmarks/ddp_main_py.py DIR --image-size 32 --epochs 15 ...

What it keeps of main.py, line by line: torchvision's ImageFolder with RandomResizedCrop(size) and
RandomHorizontalFlip, validation Resize(round(size / 0.875)) + CenterCrop(size) (main.py's 256 and 224
at size 224), ImageNet's mean and std (main.py:241-260); a torchvision model built from scratch and
wrapped in DistributedDataParallel (165, 182); plain cross-entropy; SGD over model.parameters() with
momentum 0.9 and weight decay 1e-4, the rate as given (200-204); StepLR stepped once per epoch after
validation (207, 291); the global batch divided over the processes, DistributedSampler (padded) and
DataLoader's defaults (the last partial batch kept, workers started again every pass: 180, 263-275);
validation after every epoch, each image counted once (main.py's drop_last sampler plus its loader for
the remainder, 264, 412-422). What it changes: the rate steps every --step-every epochs (main.py: 30),
the sampler's seed is --seed (main.py: 0) so that each seed pairs with hvdtrain's ``seed``, and each
epoch ends with one JSON line on rank 0 (--out) instead of the meters. ``--also-averaged-bn`` also
validates the same weights with BatchNorm's running statistics averaged over the ranks, as hvdtrain
validates (DDP itself validates with rank 0's: it broadcasts rank 0's buffers at every forward).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, models, transforms

MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def loaders(args, rank: int, world_size: int):
    normalize = transforms.Normalize(mean=MEAN, std=STD)
    train_set = datasets.ImageFolder(os.path.join(args.data, "train"), transforms.Compose([
        transforms.RandomResizedCrop(args.image_size), transforms.RandomHorizontalFlip(),
        transforms.ToTensor(), normalize]))
    val_set = datasets.ImageFolder(os.path.join(args.data, "val"), transforms.Compose([
        transforms.Resize(int(round(args.image_size / 0.875))), transforms.CenterCrop(args.image_size),
        transforms.ToTensor(), normalize]))
    train_sampler = DistributedSampler(train_set, seed=args.seed)
    train = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=train_sampler,
                       num_workers=args.workers, pin_memory=False)
    # Every validation image once: this rank's share of an unpadded split (main.py gets the same from
    # its drop_last sampler and a loader for the remainder).
    val = DataLoader(Subset(val_set, range(rank, len(val_set), world_size)), batch_size=args.batch_size // world_size,
                     num_workers=args.workers)
    return train, train_sampler, val


def validate(model, loader) -> tuple[float, float, int]:
    sums = torch.zeros(3, dtype=torch.float64)  # loss x images, correct, images
    model.eval()
    with torch.no_grad():
        for images, labels in loader:
            outputs = model(images)
            sums += torch.tensor([F.cross_entropy(outputs, labels, reduction="sum").item(),
                                  (outputs.argmax(1) == labels).sum().item(), len(labels)], dtype=torch.float64)
    dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), 100.0 * sums[1].item() / sums[2].item(), int(sums[2].item())


def main(args) -> None:
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(args.threads)
    train, train_sampler, val = loaders(args, rank, world_size)
    torch.manual_seed(args.seed)
    model = DDP(models.__dict__[args.arch](num_classes=len(train.dataset.classes)))
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=args.step_every, gamma=0.1)
    for epoch in range(args.epochs):
        start = time.perf_counter()
        train_sampler.set_epoch(epoch)
        model.train()
        sums = torch.zeros(3, dtype=torch.float64)  # loss x images, images, steps
        lr = optimizer.param_groups[0]["lr"]
        for images, labels in train:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            sums += torch.tensor([loss.item() * len(labels), len(labels), 1.0], dtype=torch.float64)
        dist.all_reduce(sums)
        averaged = {}
        if args.also_averaged_bn:
            # First the same weights with BatchNorm statistics averaged over the ranks (hvdtrain's), then
            # as main.py validates: DDP broadcasts rank 0's buffers at the start of every forward, so the
            # averaging must come before the first validation forward of the epoch.
            own = [b.detach().clone() for b in model.module.buffers()]
            for buffer in model.module.buffers():
                if buffer.is_floating_point():
                    dist.all_reduce(buffer)
                    buffer /= world_size
            averaged["val_loss_averaged_bn"], averaged["val_top1_averaged_bn"], _ = validate(model, val)
            with torch.no_grad():
                for buffer, saved in zip(model.module.buffers(), own):
                    buffer.copy_(saved)
        val_loss, val_top1, val_images = validate(model, val)
        scheduler.step()
        if rank == 0:
            record = {"epoch": epoch, "train_loss": sums[0].item() / sums[1].item(), "train_samples": int(sums[1]),
                      "steps": int(sums[2]) // world_size, "val_loss": val_loss, "val_top1": val_top1,
                      "val_samples": val_images, "lr": lr, "seconds": time.perf_counter() - start, **averaged}
            with open(args.out, "a") as handle:
                handle.write(json.dumps(record) + "\n")
    dist.barrier()  # every rank done before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="pytorch/examples' imagenet/main.py recipe under DDP")
    parser.add_argument("data")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--batch-size", type=int, default=256, help="global batch, all processes together")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--step-every", type=int, default=30, help="StepLR's step_size, in epochs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default="ddp_main_py.jsonl")
    parser.add_argument("--also-averaged-bn", action="store_true",
                        help="also validate the same weights with BatchNorm statistics averaged over the ranks")
    main(parser.parse_args())
