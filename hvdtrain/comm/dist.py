"""The one module the rest of hvdtrain asks about the job's ranks and their collectives.

Everything else asks ``dist.rank()``, ``dist.allreduce_sum(t)``, ``dist.broadcast_state(s)``,
never an engine directly. Two engines sit behind it (``dist.engine``): Horovod's
(comm/horovod_engine.py, the default) and torch.distributed's (comm/torch_engine.py, under torchrun,
srun or mpirun, with nothing but torch). ``init(engine=...)`` picks one; horovod is imported only
when its engine is picked (or something asks for one of Horovod's own names, like
``dist.HostsUpdatedInterrupt``). Every collective here is correct at world size 1 as well, so the
same code path runs a single process (no launcher) and a thousand ranks. ``rank()``, ``size()`` and
``local_rank()`` also answer before ``init()``, from the launcher's environment (comm/launcher_env.py).
Object collectives are comm/objects.py's, over whichever engine runs.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from types import ModuleType
from typing import Any, Iterable, Iterator

import torch

from ..config import ConfigError
from ..config.checks import HOROVOD_ONLY, horovod_only
from . import launcher_env as launcher
from . import objects

ENGINES = ("horovod", "torch")
_engine: ModuleType | None = None  # the engine init() started; None before


def _load(name: str) -> ModuleType:
    if name == "torch":
        from . import torch_engine
        return torch_engine
    if name == "horovod":
        try:
            from . import horovod_engine
        except ModuleNotFoundError as error:  # an install without Horovod (make setup ENGINE=torch, pip install .)
            if (error.name or "").split(".")[0] != "horovod":
                raise
            raise ConfigError(launcher.NO_HOROVOD) from None
        return horovod_engine
    raise ConfigError(f"config key 'dist.engine': expected one of {', '.join(ENGINES)}, got '{name}'")


def _active() -> ModuleType:
    """The engine init() started; before init, Horovod's (as before there were two engines: its
    collectives then fail as Horovod's do when it is not initialized)."""
    return _engine if _engine is not None else _load("horovod")


def engine() -> str:
    """The name of the engine that runs ("horovod" or "torch"); "horovod" before init()."""
    return _engine.NAME if _engine is not None else "horovod"


def init(gpu: bool | None = None, timeout_seconds: int = 0, elastic: bool = False,
         stall_warning_seconds: int | None = None, stall_shutdown_seconds: int = 0, timeline: bool = False,
         engine: str = "horovod") -> None:
    """Start ``engine`` once (idempotent) on ``gpu`` (None: whether CUDA is available). What the
    arguments mean to Horovod: horovod_engine.init; the torch engine refuses what is Horovod's
    alone (elastic, the stall inspector's shutdown, the timeline) in one line."""
    global _engine
    chosen = _load(engine)
    problem = None if initialized() else launcher.torchrun_problem(chosen.NAME)
    if problem:
        raise ConfigError(problem)
    if _engine is not None and _engine is not chosen and _engine.initialized():
        raise ConfigError(f"dist.engine={engine}: this process already runs the {_engine.NAME} engine; "
                          "start a new process to change engines")
    if chosen.NAME == "torch":
        # The Horovod-only settings init is given (the others reach the optimizer): config/checks.py's list.
        given = {"elastic.enabled": elastic, "dist.stall_shutdown_seconds": stall_shutdown_seconds,
                 "runtime.timeline": timeline}
        for setting in HOROVOD_ONLY:
            if setting.key in given and setting.asks(given[setting.key]):
                raise ConfigError(horovod_only(setting.key, setting.feature))
        chosen.init(gpu=gpu, timeout_seconds=timeout_seconds)
    else:
        chosen.init(gpu=gpu, timeout_seconds=timeout_seconds, elastic=elastic,
                    stall_warning_seconds=stall_warning_seconds, stall_shutdown_seconds=stall_shutdown_seconds,
                    timeline=timeline)
    _engine = chosen


def __getattr__(name: str) -> Any:
    """Names of one engine's own (Horovod's exceptions and elastic state, its Compression, the
    CUDA SyncBatchNorm), loaded on first use: ``import hvdtrain.comm.dist`` imports no Horovod.
    Under the torch engine, ``HorovodInternalError`` is torch.distributed's error (a lost peer)."""
    if name == "HorovodInternalError" and engine() == "torch":
        return torch.distributed.DistError
    if name == "CudaSyncBatchNorm" and engine() == "torch":
        return torch.nn.SyncBatchNorm
    if name in ("HorovodInternalError", "HostsUpdatedInterrupt", "ElasticStateBase", "Compression",
                "CudaSyncBatchNorm", "hvd", "join_problem", "refuse_join"):
        return getattr(_load("horovod"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _started() -> ModuleType | None:
    """The engine that is initialized, or None; Horovod's where something (a script of the user's)
    ran ``hvd.init()`` itself."""
    if _engine is not None:
        return _engine if _engine.initialized() else None
    hvd = sys.modules.get("horovod.torch")
    return _load("horovod") if hvd is not None and hvd.is_initialized() else None


def initialized() -> bool:
    return _started() is not None


def rank() -> int:
    """This process's rank; before ``init()``, as the launcher set it (0 without a launcher)."""
    started = _started()
    return started.rank() if started else launcher.rank()


def size() -> int:
    started = _started()
    return started.size() if started else launcher.size()


def local_rank() -> int:
    started = _started()
    return started.local_rank() if started else launcher.local_rank()


def local_size() -> int:
    return _active().local_size()


def cross_size() -> int:
    """Number of hosts taking part."""
    return _active().cross_size()


def is_primary() -> bool:
    return rank() == 0


def log(message: str) -> None:
    """Rank 0 talks; other ranks only report errors."""
    if is_primary():
        print(message, flush=True)


def controller() -> str:
    """Which controller (Horovod) or backend (torch) coordinates this job: "gloo", "mpi", "nccl"."""
    return _active().controller()


def built() -> dict[str, bool]:
    return _active().built()


def version() -> str:
    """The installed Horovod version (the torch engine: torch's)."""
    return _active().version()


def join(device: int = -1) -> int:
    """This rank has no more batches (uneven inputs): its allreduces count as zeros for the others
    until every rank has joined. Horovod's alone."""
    if engine() == "torch":
        raise ConfigError("join is Horovod's (hvd.join), which dist.engine=torch does not have: set "
                          "dist.engine=horovod, or give every rank the same number of batches")
    return _active().join(device)


def start_timeline(path: str, mark_cycles: bool = True) -> None:
    """Record Horovod's timeline (Chrome trace JSON, written by rank 0) from now on; every rank calls it."""
    _active().start_timeline(path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    _active().stop_timeline()


def elastic_run(func):
    """Horovod Elastic's retry loop: ``func(state)`` runs again after every membership change,
    once ``state`` has been rolled back (on a failure) and synchronized from rank 0."""
    return _active().elastic_run(func)


def wait_quietly(handles: Iterable[Any]) -> None:
    """Nap until the operations behind ``handles`` are done, for a short while (horovod_engine's)."""
    _active().wait_quietly(handles)


def allreduce_sum(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Sum over ranks; returns a new tensor."""
    return _active().allreduce_sum(tensor, name=name)


def allreduce_sum_async(tensor: torch.Tensor, name: str) -> Any:
    """Start a sum over ranks and return at once: ``wait(handle)`` gives the result. Every rank must
    start and wait for the same operations in the same order; ``name`` may not be in flight twice."""
    return _active().allreduce_sum_async(tensor, name)


OPS = ("sum", "average", "min", "max", "product")  # the reductions of allreduce_async_


def allreduce_async_(tensor: torch.Tensor, op: str, name: str) -> Any:
    """Start reducing ``tensor`` over ranks in place (``op``: one of ``OPS``); ``wait`` ends it."""
    return _active().allreduce_async_(tensor, op, name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str) -> Any:
    """Start overwriting ``tensor`` with ``root_rank``'s, in place; ``wait`` ends it."""
    return _active().broadcast_async_(tensor, root_rank, name)


def wait(handle: Any) -> torch.Tensor:
    """The result of an operation started by one of the ``*_async`` functions."""
    return _active().wait(handle)


def allreduce_max(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Element-wise maximum over ranks (e.g. the slowest rank's time)."""
    return _active().allreduce_max(tensor, name=name)


def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dimension 0 (of any length), in rank order."""
    return _active().allgather(tensor, name=name)


def broadcast(tensor: torch.Tensor, root_rank: int = 0, name: str | None = None) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank (a new tensor)."""
    return _active().broadcast(tensor, root_rank, name=name)


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's ``obj``, in rank order (objects.allgather_object)."""
    return objects.allgather_object(obj, _active(), name=name)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None) -> Any:
    """``root_rank``'s ``obj`` on every rank (objects.broadcast_object)."""
    return objects.broadcast_object(obj, _active(), root_rank=root_rank, name=name)


def barrier() -> None:
    _active().barrier()


@contextlib.contextmanager
def local_rank_zero_first() -> Iterator[None]:
    """Run the block on local rank 0 of every host first, then on the other ranks (e.g. one process
    per host prepares a dataset that the others then find in place). Every rank must enter it."""
    if not initialized() or size() == 1:
        yield
        return
    if local_rank() != 0:
        barrier()
    yield
    if local_rank() == 0:
        barrier()


def broadcast_state(state: Any, root_rank: int = 0) -> None:
    """Make every rank's ``state`` (state.RunState: ``state_dict(exclude=...)``,
    ``load_state_dict(d, exclude=...)``, a ``model``) equal to ``root_rank``'s: the model's tensors
    by tensor broadcast, in place; everything else as one object."""
    _active().broadcast_state(state, root_rank)


def average_buffers(model: torch.nn.Module) -> None:
    """Average floating-point buffers (BatchNorm running statistics) across ranks, in place.

    Without SyncBatchNorm each rank's running statistics follow its own shard; averaging them at
    the end of an epoch gives every rank, and the checkpoint, one and the same model to evaluate.
    """
    _active().average_buffers(model)


# The optimizers ``distributed_optimizer`` made. ``hvd.DistributedOptimizer`` returns an instance of
# a class it builds on the fly from the wrapped optimizer's class and a copy of the methods of one
# of Horovod's private classes (which call ``super(self.__class__, self)``, so the instance's class
# cannot be changed either): nothing public tells it apart from a plain optimizer. hvdtrain keeps
# its own record instead of comparing methods with Horovod's internals (the torch engine's
# optimizer is the user's own, with hooks: the same record tells it apart).
_DISTRIBUTED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def is_distributed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` came from ``distributed_optimizer`` (allreduces its gradients)."""
    return optimizer in _DISTRIBUTED


def synchronize(optimizer: torch.optim.Optimizer, quiet: bool = True) -> None:
    """Wait for the gradient allreduce of a distributed optimizer (nothing for a plain optimizer).
    ``quiet``: nap while the allreduces in flight finish before the engine's own wait (Horovod)."""
    if is_distributed(optimizer):
        _active().synchronize(optimizer, quiet=quiet)


def skip_synchronize(optimizer: torch.optim.Optimizer) -> contextlib.AbstractContextManager:
    """Around ``step()`` after ``synchronize``: step without allreducing a second time."""
    if is_distributed(optimizer):
        return _active().skip_synchronize(optimizer)
    return contextlib.nullcontext()


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
    """``optimizer`` with its gradients averaged over the ranks during backward (the engine's
    ``distributed_optimizer``): each gradient, or group of about ``bucket_mb`` MB, is sent as soon
    as backward has made it on the last of ``backward_passes_per_step`` passes; ``synchronize``
    waits for them; ``step()`` synchronizes unless inside ``skip_synchronize``. ``compression``
    "fp16": float32 gradients travel as float16. ``gradient_predivide_factor`` (Horovod's): each
    gradient divided by it before the sum, by ranks / it after."""
    wrapped = _active().distributed_optimizer(optimizer, named_parameters, compression=compression,
                                              backward_passes_per_step=backward_passes_per_step, op=op,
                                              sparse_as_dense=sparse_as_dense, bucket_mb=bucket_mb,
                                              gradient_predivide_factor=gradient_predivide_factor)
    _DISTRIBUTED.add(wrapped)
    return wrapped


def shutdown() -> None:
    if _engine is not None:
        _engine.shutdown()
