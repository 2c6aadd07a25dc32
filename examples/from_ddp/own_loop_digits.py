"""ddp_digits.py with its own loop kept, on hvdtrain: a small conv net on the 8x8 digits.

    python -P -m hvdtrain launch -np 2 -H localhost:2 --gloo python own_loop_digits.py --epochs 10

SGD at a constant learning rate, a global batch of 64, validation accuracy every epoch; a rerun
resumes from the last epoch's snapshot. docs/from-ddp.md shows the diff.
"""
import argparse
import os

import torch
import hvdtrain.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from hvdtrain.distributed import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from hvdtrain.distributed import DistributedSampler


def digits_datasets():
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    train_x, val_x, train_y, val_y = train_test_split(images, labels, test_size=0.2, stratify=labels,
                                                      random_state=0)
    return TensorDataset(train_x, train_y), TensorDataset(val_x, val_y)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc = nn.Linear(32 * 4 * 4, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc(x.flatten(1))


def evaluate(model, loader):
    sums = torch.zeros(3, dtype=torch.float64)  # loss x samples, correct, samples
    model.eval()
    with torch.no_grad():
        for images, labels in loader:
            outputs = model(images)
            sums += torch.tensor([F.cross_entropy(outputs, labels, reduction="sum").item(),
                                  (outputs.argmax(1) == labels).sum().item(), len(labels)], dtype=torch.float64)
    dist.all_reduce(sums)
    return sums[0].item() / sums[2].item(), 100 * sums[1].item() / sums[2].item()


def main(args):
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    train_set, val_set = digits_datasets()
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=train_sampler,
                              drop_last=True)
    val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if os.path.exists(args.snapshot):
        snapshot = torch.load(args.snapshot)
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        start = snapshot["epochs"]
    ddp_model = DDP(model)
    for epoch in range(start, args.epochs):
        train_sampler.set_epoch(epoch)
        ddp_model.train()
        for images, labels in train_loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(images), labels)
            loss.backward()
            optimizer.step()
        val_loss, val_accuracy = evaluate(ddp_model, val_loader)
        if rank == 0:
            print(f"epoch {epoch + 1} | val loss {val_loss:.4f} | val accuracy {val_accuracy:.2f}%", flush=True)
            dist.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epochs": epoch + 1},
                       args.snapshot)
    dist.barrier()  # every rank done (rank 0 saving) before the group goes
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a conv net on the 8x8 digits, DDP")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, all ranks together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--snapshot", default="snapshot.pt")
    main(parser.parse_args())
