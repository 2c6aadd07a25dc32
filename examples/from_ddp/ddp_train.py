"""Before: a DDP training script in the style of the PyTorch tutorial (multigpu_torchrun.py).

    torchrun --standalone --nproc-per-node 2 ddp_train.py 4 2      # 4 epochs, snapshot every 2

A classifier of 3 interleaved spirals, a synthetic dataset, DistributedSampler, DDP, a snapshot on
rank 0 every few epochs. The same training on hvdtrain is spiral_hvdtrain.py; README.md walks
through the differences. Runs on GPUs (NCCL) or on CPU (Gloo).
"""

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch.distributed import all_reduce, barrier, destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


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

    def __getitem__(self, index):
        return self.points[index], self.label[index]


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 3))


def ddp_setup() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="gloo")
    return torch.device("cpu")


class Trainer:
    def __init__(self, model, train_data, optimizer, scheduler, save_every, snapshot_path, device):
        self.device = device
        self.rank = int(os.environ["RANK"])
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.save_every = save_every
        self.epochs_run = 0
        self.snapshot_path = snapshot_path
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[device.index] if device.type == "cuda" else None)

    def _load_snapshot(self, path):
        snapshot = torch.load(path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.scheduler.load_state_dict(snapshot["SCHEDULER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss x samples, samples
        for source, targets in self.train_data:
            source, targets = source.to(self.device), targets.to(self.device)
            loss = self._run_batch(source, targets)
            sums += torch.stack([loss.double() * len(targets), torch.tensor(float(len(targets)), device=self.device)])
        all_reduce(sums)  # the epoch's loss over every rank's samples
        if self.rank == 0:
            print(f"epoch {epoch + 1} | train loss {sums[0].item() / sums[1].item():.6f}", flush=True)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "SCHEDULER_STATE": self.scheduler.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch + 1} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs(total_steps, lr):
    train_set = Spirals(2048)
    torch.manual_seed(0)  # the same initial model on every rank (DDP would broadcast rank 0's anyway)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * step / total_steps)))
    return train_set, model, optimizer, scheduler


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(), shuffle=False,
                      sampler=DistributedSampler(dataset, shuffle=True, seed=0))


def main(save_every, total_epochs, batch_size, snapshot_path, lr):
    device = ddp_setup()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    steps = total_epochs * (2048 // (batch_size * int(os.environ["WORLD_SIZE"])))
    dataset, model, optimizer, scheduler = load_train_objs(steps, lr)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, scheduler, save_every, snapshot_path, device)
    trainer.train(total_epochs)
    barrier()  # every rank done (rank 0 saving) before the group goes
    destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int, help="Input batch size on each device (default: 32)")
    parser.add_argument("--lr", default=0.05, type=float, help="Learning rate (default: 0.05)")
    parser.add_argument("--snapshot_path", default="snapshot.pt", help="Where the snapshot goes")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot_path, args.lr)
