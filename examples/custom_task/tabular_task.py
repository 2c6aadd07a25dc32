"""A task of your own: a tabular classifier on a CSV dataset, written only against hvdtrain's public
interface (docs/tasks.md). Nothing in hvdtrain knows this file; it is named by the config,

    task: tabular_task.py:TabularTask            (a path, relative to the working directory)

or handed to the Python API, ``hvdtrain.fit(TabularTask, "config.yaml")`` (train.py).

The data: rows of 8 numeric columns, one categorical column (4 levels) and a label (3 classes),
read from ``data.dir``/train.csv and val.csv. When the files are missing they are generated there
(a fixed "teacher" rule plus noise, the same on every machine), once per host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from hvdtrain import ConfigError, DataEnv, Loaders, SeededSamples, ShardedSampler, Task, loader_kwargs

NUMERIC, LEVELS, CLASSES = 8, 4, 3
TRAIN_ROWS, VAL_ROWS = 600, 101  # 101: validation shards are uneven on 2 and 3 ranks
COLUMNS = [f"x{i}" for i in range(NUMERIC)] + ["category", "label"]


def generate_csv(folder: Path) -> None:
    """train.csv and val.csv from a fixed seed; written to temporary names and renamed, so that
    processes racing without a collective (elastic workers) never read half a file."""
    rng = np.random.default_rng(1234)
    teacher = rng.normal(size=(NUMERIC + LEVELS, CLASSES))
    folder.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.csv", TRAIN_ROWS), ("val.csv", VAL_ROWS)):
        numeric = rng.normal(size=(rows, NUMERIC))
        category = rng.integers(0, LEVELS, size=rows)
        scores = np.concatenate([numeric, np.eye(LEVELS)[category]], axis=1) @ teacher
        label = (scores + rng.normal(scale=0.5, size=scores.shape)).argmax(axis=1)
        table = np.column_stack([numeric, category, label])
        partial = folder / f".{name}.{os.getpid()}"
        np.savetxt(partial, table, delimiter=",", header=",".join(COLUMNS), comments="",
                   fmt=["%.6f"] * NUMERIC + ["%d", "%d"])
        os.replace(partial, folder / name)


class Rows(Dataset):
    """One CSV file in memory; ``noise`` > 0 adds Gaussian noise to the numeric columns (augmentation)."""

    def __init__(self, path: Path, noise: float = 0.0):
        table = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64)
        self.numeric = torch.from_numpy(table[:, :NUMERIC]).float()
        self.category = torch.from_numpy(table[:, NUMERIC]).long()
        self.label = torch.from_numpy(table[:, NUMERIC + 1]).long()
        self.noise = noise

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        numeric = self.numeric[index]
        if self.noise:
            # Drawn from the global generator: SeededSamples seeds it per sample and epoch, so the
            # noise is the same whichever rank or loader worker reads the row, and after a resume.
            numeric = numeric + self.noise * torch.randn(NUMERIC)
        return numeric, self.category[index], self.label[index]


class TabularNet(torch.nn.Module):
    """An embedding for the categorical column, then an MLP with dropout."""

    def __init__(self, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(LEVELS, 4)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(NUMERIC + 4, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.1),
            torch.nn.Linear(hidden, CLASSES))

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        numeric, category = inputs
        return self.mlp(torch.cat([numeric, self.embed(category).to(numeric.dtype)], dim=1))


@dataclass
class TabularSettings:
    """The task's own keys: the config section ``tabular`` (named after the task), set like any other
    key (``tabular.hidden=64``, or a ``tabular:`` section in YAML), shown by --print-config and
    recorded in config.yaml and every checkpoint."""

    hidden: int = 32
    """Width of the MLP's hidden layer."""
    noise: float = 0.05
    """Standard deviation of the Gaussian noise added to the numeric columns in training (0 = none)."""

    def validate(self, cfg) -> None:
        if self.hidden <= 0:
            raise ConfigError(f"config key 'tabular.hidden' must be positive, got {self.hidden}")
        if self.noise < 0:
            raise ConfigError(f"config key 'tabular.noise' must be >= 0, got {self.noise}")


class TabularTask(Task):
    name = "tabular"
    settings_class = TabularSettings
    sum_fields = ("loss_sum", "correct", "count")
    # Whether each metric of summarize() is better higher ("max") or lower ("min"): best.pt and
    # train.target read it (checkpoint.best_metric=loss, train.target=95 ...).
    metric_directions = {"loss": "min", "accuracy": "max"}
    best_metric = "accuracy"
    unit = "rows"

    def data_dir(self) -> Path:
        if self.cfg.data.dir:
            return Path(self.cfg.data.dir).expanduser()
        return Path(os.environ.get("HVDTRAIN_CACHE", "~/.cache/hvdtrain")).expanduser() / "tabular-example"

    def build_loaders(self, env: DataEnv) -> Loaders:
        cfg, folder = self.cfg, self.data_dir()
        with env.local_rank_zero_first():  # one process per host generates, the others then read
            if not (folder / "val.csv").is_file():
                generate_csv(folder)
        train_set, val_set = Rows(folder / "train.csv", self.settings.noise), Rows(folder / "val.csv")
        # One global order per epoch from cfg.seed, split across ranks (resumable mid-epoch);
        # validation unpadded, so that every row is counted once.
        train_sampler = ShardedSampler(len(train_set), env.world_size, env.rank, seed=cfg.seed, shuffle=True,
                                       pad=True)
        val_sampler = ShardedSampler(len(val_set), env.world_size, env.rank, shuffle=False, pad=False)
        # data.workers, forkserver, and workers that leave SIGTERM to the trainer (preemption).
        common = {"batch_size": cfg.train.batch_size, **loader_kwargs(cfg.data, env.pin_memory)}
        # A private generator: starting an epoch must not draw from the global one (exact resume).
        train = DataLoader(SeededSamples(train_set), sampler=train_sampler, drop_last=not env.keep_partial_batches,
                           generator=torch.Generator().manual_seed(cfg.seed), **common)
        val = DataLoader(SeededSamples(val_set), sampler=val_sampler, drop_last=False,
                         generator=torch.Generator().manual_seed(cfg.seed), **common)
        return Loaders(train, val, train_sampler, len(train_set), len(val_set), val_sampler)

    def build_model(self) -> torch.nn.Module:
        return TabularNet(self.settings.hidden)

    def to_device(self, batch: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, torch.Tensor]:
        numeric, category, label = batch
        return (numeric.to(device, dtype), category.to(device)), label.to(device)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor, training: bool) -> torch.Tensor:
        smoothing = self.cfg.optim.label_smoothing if training else 0.0
        return F.cross_entropy(outputs.float(), targets, label_smoothing=smoothing)

    def metric_sums(self, loss: torch.Tensor, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        count = targets.shape[0]
        correct = (outputs.argmax(dim=1) == targets).sum()
        return torch.stack([loss.double() * count, correct.double(),
                            torch.tensor(float(count), dtype=torch.float64, device=targets.device)])

    def summarize(self, sums: torch.Tensor) -> dict[str, float]:
        loss_sum, correct, count = (float(v) for v in sums)
        if count == 0:
            return {"loss": float("nan"), "accuracy": float("nan"), "samples": 0}
        return {"loss": loss_sum / count, "accuracy": 100.0 * correct / count, "samples": int(round(count))}

    def describe(self, loaders: Loaders) -> str:
        return (f"tabular MLP (hidden {self.settings.hidden}) on {self.data_dir()}: {loaders.train_size} train / "
                f"{loaders.val_size} val rows")

    def epoch_summary(self, train: dict[str, Any], val: dict[str, Any]) -> str:
        return (f"train loss {train['loss']:.4f} acc {train['accuracy']:.2f}% | "
                f"val loss {val['loss']:.4f} acc {val['accuracy']:.2f}%")

    def checkpoint_metadata(self) -> dict[str, Any]:
        return {"hidden": self.settings.hidden, "numeric": NUMERIC, "levels": LEVELS, "classes": CLASSES}
