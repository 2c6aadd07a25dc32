"""Your own DDP loop on Horovod: the ``torch.distributed`` calls a DDP script makes, under the same
names, so that a port changes its imports and keeps its code.

    import hvdtrain.distributed as dist                              # was: import torch.distributed as dist
    from hvdtrain.distributed import DistributedDataParallel as DDP  # was: from torch.nn.parallel import ...
    from hvdtrain.distributed import DistributedSampler              # was: from torch.utils.data.distributed import ...
    dist.save(snapshot, path)                                        # was: torch.save(snapshot, path)

and starts under ``horovodrun`` or ``hvdtrain launch`` (its exit code is the ranks'), ``mpirun`` or
``srun`` instead of ``torchrun``. What each name does:

- ``init_process_group(backend)``: Horovod, once; the backend is Horovod's choice (NCCL between GPUs,
  Gloo or MPI on CPUs), so "nccl", "gloo" and "mpi" are all accepted. The GPU of this rank's local
  rank is made current, and RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE are set as torchrun
  sets them. SIGTERM, SIGUSR1 and SIGINT then stop the rank with one line and exit 75 ("run the same
  command to resume"), once any ``save`` under way has finished (a snapshot is never half written)
  and, on more than one rank, a second later (``STOP_GRACE_SECONDS``: the peers get their signals).
- ``get_rank``, ``get_world_size``, ``get_node_local_rank``, ``is_initialized``, ``barrier``,
  ``all_reduce``/``broadcast``/``all_gather`` (in place, as torch's; ``ReduceOp.SUM``, ``AVG``,
  ``MIN``, ``MAX``, ``PRODUCT``), ``all_gather_object``, ``broadcast_object_list`` (of JSON values,
  tuples, sets, bytes, tensors and numpy arrays: never pickled, so a peer cannot send code; another
  object is a TypeError naming its type), ``destroy_process_group``.
- ``DistributedDataParallel(module)``: rank 0's parameters and buffers on every rank at once, the
  gradients averaged over the ranks during backward (each sent as soon as it is ready, Horovod's
  tensor fusion grouping them), finished when backward returns, so the optimizer is yours, untouched.
  ``no_sync()``, ``broadcast_buffers`` (rank 0's buffers before each training forward, in one
  broadcast per dtype), ``.module`` and the ``module.`` prefix of its ``state_dict`` are DDP's;
  ``compression="fp16"`` sends the gradients as float16.
- ``DistributedSampler(dataset, shuffle=True, seed=0, drop_last=False)``: torch's sampler, index for
  index (the permutation of ``seed + epoch``, padded by wrapping around, rank ``r`` taking every
  n-th from ``r``), with the ranks from Horovod. ``pad=False`` (hvdtrain's) gives every sample to
  exactly one rank: validation sums then count each sample once, where torch's repeats up to
  ``world_size - 1`` of them.
- ``save(obj, path)``: ``torch.save``, atomic: the file is the old one or the new one, never a part.

What this path leaves to your script: checkpoints inside an epoch, an agreed stop at one step on
every rank, metrics.jsonl, trackers, the watchdog and elastic runs are ``hvdtrain.fit_model``'s
(docs/from-ddp.md).
"""

from __future__ import annotations

import contextlib
import datetime
import enum
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from . import outcome
from .checkpoint.io import atomic_save
from .comm import dist as _hvd
from .comm.ddp import AveragingWrapper
from .config import ConfigError
from .data.sampler import ShareKey, epoch_order, rank_share
from .ownership import UMASK

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
BACKENDS = (None, "gloo", "nccl", "mpi", "cpu:gloo,cuda:nccl")
STOP_GRACE_SECONDS = 1.0  # how long a stopping rank waits for its peers' signals to reach them


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "average"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


class _Job:
    """What this process knows of its job: the stop handlers, the save under way, the last save."""

    def __init__(self) -> None:
        self.started = False
        self.saving = False
        self.pending: int | None = None  # a stop signal that came during a save
        self.stopping = False
        self.last_save: tuple[str, float] | None = None  # (path, time) of this rank's last save
        self.calls = 0  # collectives called so far: their names, the same sequence on every rank
        self.handlers: dict = {}

    def name(self, kind: str) -> str:
        self.calls += 1
        return f"hvdtrain.distributed.{kind}.{self.calls}"


_job = _Job()


def fail(message: str) -> None:
    """Stop with hvdtrain's one line (once per job) and exit 2: a mistake in how the script uses
    this module, or a job it cannot run."""
    code = outcome.report_error(ConfigError(message))
    outcome.write_exit_record(code)
    raise SystemExit(code)


def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return _job.started and _hvd.initialized()


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: datetime.timedelta | None = None, world_size: int = -1, rank: int = -1,
                       **unused: Any) -> None:
    """Start Horovod for this job (see the module's docstring); ``init_method``, ``store`` and the
    like are torchrun's and have nothing to do here: the launcher placed the ranks."""
    if backend not in BACKENDS:
        fail(f"init_process_group: backend {backend!r} is not one hvdtrain knows; leave it out (Horovod uses "
             f"NCCL between GPUs and Gloo or MPI on CPUs) or give one of gloo, nccl, mpi")
    seconds = int(timeout.total_seconds()) if timeout is not None else 0
    try:
        _hvd.init(gpu=None, timeout_seconds=seconds)
    except ConfigError as error:
        fail(str(error))
    for asked, actual, what in ((world_size, _hvd.size(), "world_size"), (rank, _hvd.rank(), "rank")):
        if asked not in (-1, None) and asked != actual:
            fail(f"init_process_group({what}={asked}): the launcher made this process {what} {actual}; leave "
                 f"{what} out (horovodrun, mpirun or srun places the ranks)")
    os.environ.update({"RANK": str(_hvd.rank()), "WORLD_SIZE": str(_hvd.size()),
                       "LOCAL_RANK": str(_hvd.local_rank()), "LOCAL_WORLD_SIZE": str(_hvd.local_size())})
    if torch.cuda.is_available():
        torch.cuda.set_device(_hvd.local_rank() % torch.cuda.device_count())
    if not _job.started and threading.current_thread() is threading.main_thread():  # signals: main thread only
        _job.handlers = {sig: signal.signal(sig, _on_signal) for sig in STOP_SIGNALS}
    _job.started = True


def destroy_process_group(group: Any = None) -> None:
    """The process's own signal handlers back; Horovod ends with the process."""
    for sig, handler in _job.handlers.items():
        signal.signal(sig, handler)
    _job.handlers, _job.started = {}, False


def _require(what: str) -> None:
    if not is_initialized():
        fail(f"{what} needs the process group: call dist.init_process_group() first")


def get_rank(group: Any = None) -> int:
    _require("get_rank()")
    return _hvd.rank()


def get_world_size(group: Any = None) -> int:
    _require("get_world_size()")
    return _hvd.size()


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    return _hvd.local_rank()


def _no_group(group: Any, what: str) -> None:
    if group is not None:
        fail(f"{what}(group=...): hvdtrain.distributed has one group, all ranks; leave group out")


class Work:
    """An operation started with ``async_op=True``: ``wait()`` ends it (None: one already done)."""

    def __init__(self, handle: int | None):
        self.handle, self.done = handle, handle is None

    def wait(self, timeout: Any = None) -> bool:
        if not self.done:
            _hvd.wait(self.handle)
            self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


def _run(handle: int, async_op: bool) -> Work | None:
    work = Work(handle)
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` over the ranks, in place (the sum unless ``op`` says otherwise)."""
    _require("all_reduce()")
    _no_group(group, "all_reduce")
    return _run(_hvd.allreduce_async_(tensor, ReduceOp(op).value, _job.name("all_reduce")), async_op)


def broadcast(tensor: torch.Tensor, src: int = 0, group: Any = None, async_op: bool = False) -> Work | None:
    """``src``'s ``tensor`` on every rank, in place."""
    _require("broadcast()")
    _no_group(group, "broadcast")
    return _run(_hvd.broadcast_async_(tensor, src, _job.name("broadcast")), async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Work | None:
    """Every rank's ``tensor`` into ``tensor_list``, in rank order."""
    _require("all_gather()")
    _no_group(group, "all_gather")
    if len(tensor_list) != _hvd.size():
        fail(f"all_gather: tensor_list has {len(tensor_list)} tensors for {_hvd.size()} ranks")
    gathered = _hvd.allgather(tensor.unsqueeze(0), name=_job.name("all_gather"))
    for target, part in zip(tensor_list, gathered):
        target.copy_(part)
    return Work(None) if async_op else None


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    _require("all_gather_object()")
    _no_group(group, "all_gather_object")
    object_list[:] = _hvd.allgather_object(obj, name=_job.name("all_gather_object"))


def broadcast_object_list(object_list: list[Any], src: int = 0, group: Any = None, device: Any = None) -> None:
    _require("broadcast_object_list()")
    _no_group(group, "broadcast_object_list")
    object_list[:] = _hvd.broadcast_object(list(object_list) if _hvd.rank() == src else None, root_rank=src,
                                           name=_job.name("broadcast_object_list"))


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> None:
    _require("barrier()")
    _hvd.barrier()


# --- saves and stops ---------------------------------------------------------------------------


def save(obj: Any, f: str | os.PathLike | Any) -> None:
    """``torch.save(obj, f)``; to a path, atomically (a temporary file in the same folder, synced,
    then renamed over ``f``). A stop signal during it waits until the file is whole."""
    _job.saving = True
    try:
        if isinstance(f, (str, os.PathLike)):
            Path(f).parent.mkdir(parents=True, exist_ok=True)
            atomic_save(obj, Path(f), share=UMASK)  # readable as the umask allows, as torch.save's file
            _job.last_save = (str(f), time.time())
        else:
            torch.save(obj, f)
    finally:
        _job.saving = False
        if _job.pending is not None:
            _stop(_job.pending)


def _on_signal(signum: int, _frame: Any) -> None:
    if _job.saving:
        _job.pending = signum
        return
    _stop(signum)


def _stop(signum: int) -> None:
    """End this rank at once with exit 75. Rank 0 says why and where a rerun resumes (the last save
    it made); every rank leaves its exit record (``hvdtrain launch`` takes rank 0's cause). The
    launchers signal every rank (horovodrun and hvdtrain launch pass theirs on, mpirun and Slurm
    signal the job's tasks), so the ranks leave together, none waiting for a peer that is gone."""
    if _job.stopping:  # the launcher's own SIGTERM after the first signal: already on the way out
        os._exit(outcome.EXIT_PREEMPTED)
    _job.stopping = True
    rank = _hvd.rank() if _hvd.initialized() else 0
    if _job.last_save is not None:
        path, when = _job.last_save
        resume = f"from {path} (saved {time.strftime('%H:%M:%S', time.localtime(when))})"
    else:
        resume = "from your script's last save" + (" (none in this run)" if rank == 0 else "")
    cause = f"rank {rank} stopped by {signal.Signals(signum).name}: run the same command to resume {resume}"
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if rank == 0:  # the others' records name no cause: hvdtrain launch then reports rank 0's
        sys.stderr.write(f"hvdtrain: {cause}\n")
        outcome.note_cause(cause)
    outcome.write_exit_record(outcome.EXIT_PREEMPTED)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    # The launcher signals the ranks one after another: a rank that left at once could close its
    # connections before a peer's signal arrives, and that peer, inside a collective, would stop on
    # Horovod's error with a traceback instead. So every rank waits a moment here first.
    if _hvd.initialized() and _hvd.size() > 1:
        time.sleep(STOP_GRACE_SECONDS)
    # Then without unwinding: this rank may be inside a collective whose peers are ending too, and
    # Horovod's shutdown at exit would wait for them.
    os._exit(outcome.EXIT_PREEMPTED)


# --- the sampler -----------------------------------------------------------------------------


class DistributedSampler(Sampler[int]):
    """torch's ``DistributedSampler``, index for index, with the ranks from Horovod; ``pad=False``
    gives every sample to exactly one rank (the shares then differ by one at most)."""

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, pad: bool = True):
        self.dataset = dataset
        self.num_replicas = _hvd.size() if num_replicas is None else num_replicas
        self.rank = _hvd.rank() if rank is None else rank
        if not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"Invalid rank {self.rank}, rank should be in the interval [0, {self.num_replicas - 1}]")
        self.shuffle, self.seed, self.drop_last, self.pad = shuffle, seed, drop_last, pad
        self.epoch = 0
        total = len(dataset)
        if drop_last and total % self.num_replicas:
            self.num_samples = math.ceil((total - self.num_replicas) / self.num_replicas)
        elif pad:
            self.num_samples = math.ceil(total / self.num_replicas)
        else:
            self.num_samples = len(range(self.rank, total, self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas if (pad or drop_last) else total

    def __iter__(self) -> Iterator[int]:
        if self.drop_last:  # the tail that the ranks do not divide is left out
            order = epoch_order(len(self.dataset), self.seed, self.epoch, self.shuffle)
            return iter(order[self.rank:self.total_size:self.num_replicas].tolist())
        # hvdtrain's own split: with pad, the order again from its beginning, as torch's padding does
        return iter(rank_share(ShareKey(len(self.dataset), self.num_replicas, self.rank, self.seed, self.shuffle,
                                        self.pad, self.epoch, 0)).tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


# --- the model wrapper ---------------------------------------------------------------------------


class DistributedDataParallel(AveragingWrapper):
    """DDP's wrapper on Horovod (comm/ddp.py does the work): see the module's docstring.
    ``device_ids``, ``output_device``, ``bucket_cap_mb``, ``gradient_as_bucket_view`` and
    ``static_graph`` are accepted and change nothing (the module runs where it is; Horovod groups
    the gradients itself)."""

    def __init__(self, module: torch.nn.Module, device_ids: Any = None, output_device: Any = None, dim: int = 0,
                 broadcast_buffers: bool = True, process_group: Any = None, bucket_cap_mb: Any = None,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, *, compression: str | None = None):
        _require("DistributedDataParallel")
        _no_group(process_group, "DistributedDataParallel")
        if compression not in (None, "none", "fp16"):
            fail(f"DistributedDataParallel(compression={compression!r}): give None or 'fp16'")
        super().__init__(module, broadcast_buffers=broadcast_buffers, fp16=compression == "fp16")
