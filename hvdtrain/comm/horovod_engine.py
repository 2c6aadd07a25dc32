"""The Horovod engine behind comm/dist.py (``dist.engine=horovod``, the default): Horovod's training
side (horovod.torch), imported only when this engine is chosen. comm/dist.py is the facade the rest
of hvdtrain asks; every function here is one of its collectives, correct at world size 1 as well.
The environment Horovod starts from is comm/horovod_env.py's, the gradient groups comm/buckets.py's.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from typing import Any, Iterable

import horovod.torch as hvd
import torch
from horovod.common.elastic import State as ElasticStateBase
from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

from ..config import ConfigError
from . import launcher_env as launcher
from .buckets import gradient_buckets
from .horovod_env import GLOO_RENDEZVOUS, apply_env_defaults, apply_stall_inspector, check_elastic_env
from .objects import broadcast_object

Compression = hvd.Compression
__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt", "ElasticStateBase"]
NAME = "horovod"
# Horovod's SyncBatchNorm runs on CUDA tensors only; model/sync_bn.py has the CPU counterpart.
CudaSyncBatchNorm = hvd.SyncBatchNorm


def init(gpu: bool | None = None, timeout_seconds: int = 0, elastic: bool = False,
         stall_warning_seconds: int | None = None, stall_shutdown_seconds: int = 0, timeline: bool = False) -> None:
    """Initialize Horovod once (idempotent), after hvdtrain's environment defaults for ``gpu`` (None:
    whether CUDA is available).

    A Gloo collective gives up after HOROVOD_GLOO_TIMEOUT_SECONDS (30 by default); a longer
    ``timeout_seconds`` raises it so that slow but healthy phases are not cut short. Settings the
    user exported win, except those an ``elastic`` run cannot survive (a one-line error).

    ``stall_warning_seconds`` / ``stall_shutdown_seconds`` set Horovod's stall inspector (None:
    leave it as the environment has it; 0 warning seconds turns it off), unless the user exported
    its variables: a start-up line then says the exported ones apply (``apply_stall_inspector``). ``timeline`` lets
    ``start_timeline`` record a timeline later (HOROVOD_TIMELINE=DYNAMIC).
    """
    if elastic:
        check_elastic_env()
    if timeout_seconds > 30:
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(timeout_seconds))
    note = ""
    if stall_warning_seconds is not None and not hvd.is_initialized():
        note = apply_stall_inspector(stall_warning_seconds, stall_shutdown_seconds)
    if timeline:
        os.environ.setdefault("HOROVOD_TIMELINE", "DYNAMIC")
    if GLOO_RENDEZVOUS in os.environ and not hvd.is_initialized():
        problem = launcher.hostname_problem()  # else Horovod's Gloo init segfaults without a word
        problem = problem or launcher.loopback_name_problem()  # else a C++ IoException on the other hosts
        if problem:
            raise ConfigError(problem)
    if not hvd.is_initialized():
        apply_env_defaults(torch.cuda.is_available() if gpu is None else gpu, elastic=elastic)
        hvd.init()
        if join_problem():
            hvd.join = refuse_join  # a task's own hvd.join() stops with the line, not a hang
        if note and hvd.rank() == 0:
            print(note, flush=True)


def join_problem() -> str | None:
    """Why ``hvd.join`` cannot work on this host, or None.

    A Horovod built with GPU operations runs join through its GPU code path even for CPU tensors:
    on a host without a GPU driver it hangs under Gloo (one rank waits in the next collective, the
    other in join, forever) and fails under MPI ("Could not dlopen libcuda.so")."""
    if (hvd.nccl_built() or hvd.cuda_built()) and not torch.cuda.is_available():
        return ("join is not available here: this Horovod was built with GPU operations (NCCL), and on a "
                "host without a GPU driver join hangs under Gloo and fails under MPI; rebuild it with CPU "
                "operations (HVDTRAIN_GPU_OPS=none make setup; make setup's auto does so where no driver is "
                "found) or run on a GPU host")
    return None


def refuse_join(device: int = -1) -> int:
    raise ConfigError(join_problem() or "join is not available here")


def join(device: int = -1) -> int:
    """This rank has no more batches (uneven inputs): its allreduces count as zeros for the others
    until every rank has joined. Blocks until then; returns the rank that joined last."""
    problem = join_problem()
    if problem:
        raise ConfigError(problem)
    return hvd.join(device)


def start_timeline(path: str, mark_cycles: bool = True) -> None:
    """Record Horovod's timeline (Chrome trace JSON, written by rank 0) from now on; every rank calls it."""
    hvd.start_timeline(path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    hvd.stop_timeline()


def initialized() -> bool:
    return bool(hvd.is_initialized())


def rank() -> int:
    """This process's rank; before ``init()``, as the launcher set it (0 without a launcher), so
    that the helpers below (``average_buffers``, ``broadcast_state``) answer for one process, as
    they did when they lived in the facade."""
    return hvd.rank() if hvd.is_initialized() else launcher.rank()


def size() -> int:
    return hvd.size() if hvd.is_initialized() else launcher.size()


def local_rank() -> int:
    return hvd.local_rank()


def local_size() -> int:
    return hvd.local_size()


def cross_size() -> int:
    """Number of hosts taking part."""
    return hvd.cross_size()


def controller() -> str:
    """Which controller coordinates this job: "gloo" or "mpi"."""
    if hvd.gloo_enabled():
        return "gloo"
    if hvd.mpi_enabled():
        return "mpi"
    return "unknown"


def built() -> dict[str, bool]:
    return {"mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()), "nccl": bool(hvd.nccl_built()),
            "cuda": bool(hvd.cuda_built())}  # GPU operations: NCCL, or CUDA-aware MPI


def version() -> str:
    """The installed Horovod version."""
    import horovod

    return horovod.__version__


# How long a quiet wait sleeps between two looks at an operation in flight, and for how long it looks.
QUIET_POLL_SECONDS = 0.0001
QUIET_POLL_LIMIT_SECONDS = 0.05


def wait_quietly(handles: Iterable[Any]) -> None:
    """Sleep in short naps until Horovod has finished the operations behind ``handles`` (its
    integer handles; others are skipped), looking every ``QUIET_POLL_SECONDS`` for at most
    ``QUIET_POLL_LIMIT_SECONDS`` in all; the caller's ``hvd.synchronize`` then waits for the rest.

    The work waited for runs on Horovod's background thread and Gloo's threads, on the same cores
    as the waiting thread. The digits model on 2 CPU ranks, each bound to a core
    (``benchmarks/stop_agreement.py --bind rank``, medians of 3): 11.77 ms a step with Horovod's
    own wait, 10.03 ms looking every 0.1 ms; unbound, 9.87 and 8.94 (DDP: 8.93). The looks cost CPU
    (about 10% of a core while they go on), so a long wait, for a late rank, is Horovod's own: with
    Horovod patch 0002 it sleeps on a condition variable (tests/parallel/test_observability.py: rank 0's
    thread used 0.30-0.33 s of CPU in a 3 s wait when the looks had no limit)."""
    deadline = time.perf_counter() + QUIET_POLL_LIMIT_SECONDS
    for handle in handles:
        if not isinstance(handle, int):
            continue
        while not hvd.poll(handle):
            if time.perf_counter() > deadline:
                return
            time.sleep(QUIET_POLL_SECONDS)


def allreduce_sum(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Sum over ranks; returns a new tensor (waited for quietly: ``wait_quietly``)."""
    return wait(hvd.allreduce_async(tensor, op=hvd.Sum, name=name))


def allreduce_sum_async(tensor: torch.Tensor, name: str) -> int:
    """Start a sum over ranks and return at once: ``wait(handle)`` gives the result. Every rank must
    start and wait for the same operations in the same order; ``name`` may not be in flight twice."""
    return hvd.allreduce_async(tensor, op=hvd.Sum, name=name)


# Reductions by name, for the in-place operations the torch.distributed calls of distributed.py make.
OPS = {"sum": hvd.Sum, "average": hvd.Average, "min": hvd.Min, "max": hvd.Max, "product": hvd.Product}


def allreduce_async_(tensor: torch.Tensor, op: str, name: str) -> int:
    """Start reducing ``tensor`` over ranks in place (``op``: a key of ``OPS``); ``wait`` ends it."""
    return hvd.allreduce_async_(tensor, op=OPS[op], name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str) -> int:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; ``wait`` ends it."""
    return hvd.broadcast_async_(tensor, root_rank, name=name)


def wait(handle: int) -> torch.Tensor:
    """The result of an operation ``allreduce_sum_async`` started (waits quietly until every rank
    sent it: ``wait_quietly``)."""
    wait_quietly([handle])
    return hvd.synchronize(handle)


def allreduce_max(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Element-wise maximum over ranks (e.g. the slowest rank's time)."""
    return hvd.allreduce(tensor, op=hvd.Max, name=name)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0, in rank order."""
    return hvd.allgather(tensor, name=name)


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    return hvd.broadcast(tensor, root_rank, name=name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str) -> None:
    """Overwrite ``tensor`` with ``root_rank``'s, in place (blocking)."""
    hvd.broadcast_(tensor, root_rank, name=name)


def barrier() -> None:
    hvd.barrier()


def broadcast_state(state: Any, root_rank: int = 0) -> None:
    """Make every rank's ``state`` equal to ``root_rank``'s.

    ``state`` has ``state_dict(exclude=...)`` / ``load_state_dict(d, exclude=...)`` and a ``model``
    (state.RunState): the model's tensors go by Horovod's tensor broadcast, in place; everything
    else (optimizer, GradScaler, position, registered components) as one object (comm/objects.py:
    never Horovod's ``broadcast_object``, which unpickles what the root sends).

    The optimizer state is never sent with Horovod's ``broadcast_optimizer_state``: that initializes
    an empty state with a zero-gradient ``step()``, which applies weight decay to the parameters.
    """
    hvd.broadcast_parameters(state.model.state_dict(), root_rank=root_rank)
    rest = state.state_dict(exclude=("model",)) if rank() == root_rank else None
    rest = broadcast_object(rest, sys.modules[__name__], root_rank=root_rank, name="hvdtrain.train.state")
    if rank() != root_rank:
        state.load_state_dict(rest, exclude=("model",))


def synchronize(optimizer: torch.optim.Optimizer, quiet: bool = True) -> None:
    """Wait for the gradient allreduce of a distributed optimizer (the facade passes only those).
    ``quiet``: nap while the allreduces in flight finish (``wait_quietly``) before Horovod's own
    wait; Horovod's ``synchronize`` then finds them done (and starts, and waits for, those of
    parameters that got no gradient)."""
    if quiet:
        # DistributedOptimizer._handles: parameter (or group) -> (handle, context); None until sent.
        wait_quietly(handle for handle, _ in list(getattr(optimizer, "_handles", {}).values()))
    optimizer.synchronize()


def skip_synchronize(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """Around ``step()`` after ``synchronize``: step without allreducing a second time."""
    return optimizer.skip_synchronize()


def average_buffers(model: torch.nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics) across ranks, in place.

    Without SyncBatchNorm each rank's running statistics follow its own shard; averaging them at
    the end of an epoch gives every rank, and the checkpoint, one and the same model to evaluate.
    """
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if size() > 1 and buffers:
        hvd.grouped_allreduce_(buffers, op=hvd.Average, name="average_buffers")


def distributed_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
    compression: str,
    backward_passes_per_step: int,
    op: str,
    sparse_as_dense: bool = False,
    bucket_mb: float = 0,
    gradient_predivide_factor: float = 1.0,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that gradients are allreduced during backward.

    Sparse gradients (embeddings with ``sparse=True``) go through Horovod's sparse path, an
    allgather of every rank's indices and values, or with ``sparse_as_dense`` are made dense and
    allreduced like the rest. With ``bucket_mb`` the gradients go in groups of about that size
    (``gradient_buckets``); the caller leaves it 0 where gradients may be sparse."""
    named_parameters = list(named_parameters)
    groups = None
    # Horovod's Adasum optimizer takes no groups, and its grouped allreduce leaves out the predivision.
    if bucket_mb > 0 and op != "adasum" and gradient_predivide_factor == 1:
        groups = gradient_buckets([p for _, p in named_parameters], bucket_mb)
    return hvd.DistributedOptimizer(
        optimizer,
        named_parameters=named_parameters,
        compression=Compression.fp16 if compression == "fp16" else Compression.none,
        backward_passes_per_step=backward_passes_per_step,
        op=hvd.Adasum if op == "adasum" else hvd.Average,
        sparse_as_dense=sparse_as_dense,
        groups=groups,
        gradient_predivide_factor=gradient_predivide_factor,
    )


def elastic_run(func):
    """Horovod Elastic's retry loop: ``func(state)`` runs again after every membership change,
    once ``state`` has been rolled back (on a failure) and synchronized from rank 0."""
    return hvd.elastic.run(func)


def shutdown() -> None:
    if hvd.is_initialized():
        hvd.shutdown()
