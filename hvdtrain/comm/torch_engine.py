"""The torch.distributed engine behind comm/dist.py (``dist.engine=torch``): nothing but torch.

Where the job's place comes from: torchrun's RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; under
srun or mpirun (one process per rank) the launcher's rank and size (comm/launcher_env.py) with
MASTER_ADDR and MASTER_PORT exported by the job script; a single process without any launcher
needs nothing (an in-memory store). The ranks meet in comm/job_store.py's store: bound to
MASTER_ADDR's address, open only to processes that prove HVDTRAIN_JOB_SECRET, its values signed.
Gloo on CPU, NCCL on GPU. Collectives are matched by the order ranks start them (Horovod matches
names): every rank must start the same ones in the same order, which the training loop does
already, since Horovod's names are issued in the same order too.
On GPU the group has two backends: NCCL for CUDA tensors, Gloo for CPU ones (metric sums, objects).
The distributed optimizer is comm/torch_optimizer.py's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from typing import Any, Iterable

import torch
import torch.distributed as tdist

from ..config import ConfigError
from . import job_store
from . import launcher_env as launcher
from .objects import allgather_object, broadcast_object
from .torch_optimizer import GradientAverager

NAME = "torch"
_hosts = {"local_rank": 0, "local_size": 1, "cross_size": 1}  # this rank's host, counted at init
REDUCE_OPS = {"sum": tdist.ReduceOp.SUM, "average": tdist.ReduceOp.SUM, "min": tdist.ReduceOp.MIN,
              "max": tdist.ReduceOp.MAX, "product": tdist.ReduceOp.PRODUCT}


def init(gpu: bool | None = None, timeout_seconds: int = 0) -> None:
    """Join the process group once (idempotent). A collective gives up after ``timeout_seconds``
    (at least 30 s, Horovod's Gloo default), so that hvdtrain's watchdog, not a silent hang, ends a
    job with a lost rank; the rendezvous waits as long."""
    if tdist.is_initialized():
        return
    gpu = torch.cuda.is_available() if gpu is None else gpu
    rank, world_size = launcher.rank(), launcher.size()  # torchrun's, else srun's or mpirun's
    timeout = datetime.timedelta(seconds=max(30, timeout_seconds))
    # On GPU, CUDA tensors (gradients) go by NCCL and CPU tensors (metric sums, encoded objects, the
    # stop agreement) by Gloo, as Horovod sends CPU tensors by its CPU operations.
    backend = "cpu:gloo,cuda:nccl" if gpu else "gloo"
    if gpu:  # NCCL's communicator takes the current device: this rank's, as the trainer pins it
        torch.cuda.set_device(launcher.local_rank() % torch.cuda.device_count())
    if world_size == 1 and "MASTER_ADDR" not in os.environ:
        tdist.init_process_group(backend, store=tdist.HashStore(), rank=0, world_size=1, timeout=timeout)
    else:
        missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
        if missing:
            raise ConfigError(f"dist.engine=torch needs {' and '.join(missing)} (rank 0's host and a free port): "
                              "launch with torchrun, or export them in the job script for srun or mpirun "
                              "(e.g. MASTER_ADDR=$(hostname) and a free port as MASTER_PORT, one per job)")
        problem = launcher.loopback_name_problem("GLOO_SOCKET_IFNAME", "export GLOO_SOCKET_IFNAME={iface} "
                                                                           "(the interface the hosts share)")
        if problem:  # else the other hosts' ranks fail to connect, in C++, once they reach this one
            raise ConfigError(problem)
        store = job_store.join(rank, world_size, timeout)  # bound to MASTER_ADDR, ranks proven, values signed
        tdist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    count_hosts()


def count_hosts() -> None:
    """This rank's place among the ranks of its host (by host name, like Horovod's local rank)."""
    names = allgather_object(launcher.host_name(), sys.modules[__name__], name="hvdtrain.hosts")
    mine = names[rank()]
    _hosts.update(local_rank=names[:rank()].count(mine), local_size=names.count(mine), cross_size=len(set(names)))


def initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank()


def size() -> int:
    return tdist.get_world_size()


def local_rank() -> int:
    return _hosts["local_rank"]


def local_size() -> int:
    return _hosts["local_size"]


def cross_size() -> int:
    return _hosts["cross_size"]


def controller() -> str:
    """"gloo" on CPU; "nccl" on GPU (where CPU tensors still go by Gloo)."""
    return "nccl" if "nccl" in str(tdist.get_backend()) else "gloo"


def built() -> dict[str, bool]:
    return {"mpi": tdist.is_mpi_available(), "gloo": tdist.is_gloo_available(), "nccl": tdist.is_nccl_available(),
            "cuda": torch.cuda.is_available()}


def version() -> str:
    return torch.__version__


def refuse(feature: str, key: str) -> Any:
    raise ConfigError(f"{feature} is Horovod's, which dist.engine=torch does not have: set dist.engine=horovod "
                      f"(and launch with horovodrun) or turn {key} off")


def start_timeline(path: str, mark_cycles: bool = True) -> None:
    refuse("the timeline", "runtime.timeline")


def stop_timeline() -> None:
    refuse("the timeline", "runtime.timeline")


def elastic_run(func):
    refuse("Horovod Elastic", "elastic.enabled")


def wait_quietly(handles: Iterable[Any]) -> None:
    """Nothing to do: a torch.distributed wait sleeps on a condition variable already."""


class Pending:
    """An operation in flight: ``wait`` gives ``tensor`` once ``work`` is done, after ``finish``."""

    def __init__(self, work: Any, tensor: torch.Tensor, finish=None):
        self.work, self.tensor, self.finish = work, tensor, finish


def _start(tensor: torch.Tensor, op: str) -> Pending:
    work = tdist.all_reduce(tensor, op=REDUCE_OPS[op], async_op=True) if size() > 1 else None
    finish = (lambda t: t.div_(size())) if op == "average" and size() > 1 else None
    return Pending(work, tensor, finish)


def wait(handle: Pending) -> torch.Tensor:
    if handle.work is not None:
        handle.work.wait()
    if handle.finish is not None:
        handle.finish(handle.tensor)
    return handle.tensor


def allreduce_sum(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    return wait(_start(tensor.clone(), "sum"))


def allreduce_sum_async(tensor: torch.Tensor, name: str) -> Pending:
    return _start(tensor.clone(), "sum")


def allreduce_async_(tensor: torch.Tensor, op: str, name: str) -> Pending:
    return _start(tensor, op)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str) -> Pending:
    work = tdist.broadcast(tensor, root_rank, async_op=True) if size() > 1 else None
    return Pending(work, tensor)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> None:
    wait(broadcast_async_(tensor, root_rank, name or ""))


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    return wait(broadcast_async_(tensor.clone(), root_rank, name or ""))


def allreduce_max(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    return wait(_start(tensor.clone(), "max"))


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order; lengths may differ
    (Horovod's allgather allows it, torch's does not: padded to the longest, then cut)."""
    tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
    if size() == 1:
        return tensor.clone()
    length = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(size())]
    tdist.all_gather(lengths, length)
    longest = int(max(int(n) for n in lengths))
    padded = tensor.new_zeros((longest, *tensor.shape[1:]))
    padded[:tensor.shape[0]] = tensor
    gathered = [torch.empty_like(padded) for _ in range(size())]
    tdist.all_gather(gathered, padded)
    return torch.cat([part[:int(n)] for part, n in zip(gathered, lengths)])


def barrier() -> None:
    if size() > 1:
        tdist.barrier()


def broadcast_tensors(tensors: list[torch.Tensor], root_rank: int) -> None:
    """``root_rank``'s ``tensors`` on every rank, in place: one broadcast per dtype and device."""
    if size() == 1 or not tensors:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group])
        tdist.broadcast(flat, root_rank)
        offset = 0
        with torch.no_grad():
            for t in group:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_state(state: Any, root_rank: int = 0) -> None:
    """The model's tensors by tensor broadcast, in place; the rest (optimizer, GradScaler, position,
    registered components) as one object (comm/objects.py)."""
    broadcast_tensors(list(state.model.state_dict().values()), root_rank)
    rest = state.state_dict(exclude=("model",)) if rank() == root_rank else None
    rest = broadcast_object(rest, sys.modules[__name__], root_rank=root_rank, name="hvdtrain.train.state")
    if rank() != root_rank:
        state.load_state_dict(rest, exclude=("model",))


def average_buffers(model: torch.nn.Module) -> None:
    buffers = [b for b in model.buffers() if b.is_floating_point()]
    if size() > 1 and buffers:
        for buffer in buffers:
            tdist.all_reduce(buffer)
            buffer.div_(size())


def synchronize(optimizer: torch.optim.Optimizer, quiet: bool = True) -> None:
    GradientAverager.of(optimizer).synchronize()


def skip_synchronize(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    return GradientAverager.of(optimizer).skip_synchronize()


def distributed_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
                          compression: str, backward_passes_per_step: int, op: str, sparse_as_dense: bool = False,
                          bucket_mb: float = 0, gradient_predivide_factor: float = 1.0) -> torch.optim.Optimizer:
    """``optimizer`` itself, with gradient hooks that average over the ranks (GradientAverager)."""
    if op == "adasum" or gradient_predivide_factor != 1:
        raise ConfigError(f"{'dist.op=adasum' if op == 'adasum' else 'dist.gradient_predivide_factor'} is Horovod's, "
                          "which dist.engine=torch does not have: leave it at its default or set dist.engine=horovod")
    GradientAverager(optimizer, list(named_parameters), fp16=compression == "fp16",
                     passes=backward_passes_per_step, bucket_mb=bucket_mb, sparse_as_dense=sparse_as_dense,
                     start=allreduce_async_, wait=wait)
    return optimizer


def shutdown() -> None:
    if initialized():
        tdist.destroy_process_group()

