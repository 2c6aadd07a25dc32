"""DataLoader plumbing shared by every task: worker set-up and shutdown, loader arguments, and
the bundle of loaders a task hands to the trainer."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from torch.utils.data import DataLoader

from ..comm import launcher_env as launcher
from ..config import DataConfig
from .sampler import ShardedSampler


def init_worker(worker_id: int, trainer_pid: int, quiet: bool = False) -> None:
    """Set up a loader worker.

    A worker of a rank other than 0 (``quiet``) prints no warning: at 512 ranks with 2 workers each,
    a library's warning would come 1,024 times. Rank 0's workers print theirs.

    Workers leave SIGTERM, SIGUSR1 and SIGINT (a terminal's Ctrl-C reaches the whole process group)
    to the training process, which stops at a step boundary and checkpoints; a worker killed by the
    same signal would fail the next batch first. In exchange
    a worker must not outlive the training process: forkserver workers are children of the fork
    server, not of the trainer, so PyTorch's parent check does not see the trainer die.
    """
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    if quiet:
        warnings.simplefilter("ignore")

    def exit_with_trainer() -> None:
        while True:
            time.sleep(2.0)
            try:
                os.kill(trainer_pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass

    threading.Thread(target=exit_with_trainer, name="hvdtrain-orphan-check", daemon=True).start()


def shutdown_workers(*loaders: object) -> None:
    """Stop persistent loader workers now rather than at interpreter exit."""
    for loader in loaders:
        loader = getattr(loader, "loader", loader)  # CountingLoader wraps a DataLoader
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()


# What the forkserver imports once, before it forks the first worker: each worker then starts with
# torch loaded instead of importing it itself (about 5 s of CPU each, at every start of a job; a 2-rank
# test job with 2 workers per loader took 25 s without, 20-21 s with, on 2 cores). A module missing
# here is skipped by the forkserver and imported by the worker that needs it.
FORKSERVER_PRELOAD = ["torch", "torchvision", "hvdtrain.data.loaders"]


def loader_kwargs(data: DataConfig, pin_memory: bool) -> dict:
    kwargs: dict = {"num_workers": data.workers, "pin_memory": pin_memory}
    if data.workers > 0:
        kwargs["worker_init_fn"] = functools.partial(init_worker, trainer_pid=os.getpid(), quiet=launcher.rank() != 0)
        kwargs["persistent_workers"] = True
        kwargs["prefetch_factor"] = data.prefetch_factor
        # Forking a process that has initialized MPI/NCCL/CUDA is unsafe; forkserver forks from a
        # clean server process instead (as Horovod's ImageNet example does).
        if data.mp_context in multiprocessing.get_all_start_methods():
            kwargs["multiprocessing_context"] = data.mp_context
            if data.mp_context == "forkserver":
                multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
    return kwargs


@dataclass
class Loaders:
    """A task's loaders for one rank, and what the trainer needs to know about them."""

    train: Sequence | DataLoader
    val: Sequence | DataLoader
    train_sampler: ShardedSampler | None  # None: the loader has no resumable position (synthetic data)
    train_size: int                       # training samples in an epoch, all ranks together
    val_size: int
    val_sampler: ShardedSampler | None = None
    note: str = ""                        # a start-up line about the data (e.g. where the file index came from)

    def reshard(self, rank: int, world_size: int) -> None:
        """After the number of ranks changed (elastic training)."""
        for sampler in (self.train_sampler, self.val_sampler):
            if sampler is not None:
                sampler.rank, sampler.num_replicas = rank, world_size


def index_cache_dir(data: DataConfig) -> Path | None:
    from .demo import cache_root

    return cache_root() if data.index_cache else None
