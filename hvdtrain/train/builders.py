"""The builders ``run.setup`` is made of: each small, each identical on every rank.

Under elastic mode none of them calls a collective: a worker may join a job whose other ranks are
inside the state synchronization.
"""

from __future__ import annotations

import contextlib
import os
from typing import Mapping

import torch

from ..comm import dist
from ..config import Config
from ..data import DataError
from ..data.loaders import Loaders
from ..data.sampler import ShardedSampler
from ..fault.liveness import LivenessService, Peer, listen_addresses
from ..model.finetune import apply_freeze
from ..model.sync_bn import convert_sync_batchnorm
from ..optim.build import LRSchedule
from ..optim.build import build_optimizer as build_named_optimizer
from ..tasks import DataEnv, Task
from .in_effect import per_rank_batch


def wants_gpu(cfg: Config) -> bool:
    return cfg.runtime.device == "cuda" or (cfg.runtime.device == "auto" and torch.cuda.is_available())


def pick_device(cfg: Config) -> torch.device:
    if wants_gpu(cfg):
        if not torch.cuda.is_available():
            raise DataError("runtime.device=cuda but no CUDA device is visible (use runtime.device=cpu)")
        index = dist.local_rank() % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def threads_per_rank(cfg: Config, own_cores: list[int] | None = None, launcher_bound: bool | None = None,
                     env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The intra-op threads of this rank and where the number came from, for the start-up line:
    runtime.threads; else the allocation's CPUs per task (SLURM_CPUS_PER_TASK); else this rank's
    own cores (runtime.cpu_affinity), or the process's affinity mask where the launcher or the
    scheduler narrowed it; else OMP_NUM_THREADS; else its share of the host's cores."""
    mask = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return thread_count(cfg.runtime.threads, os.environ if env is None else env, own_cores, len(mask),
                        os.cpu_count() or 1, dist.local_size(), launcher_bound)


def positive(text: str | None) -> int | None:
    return int(text) if text and text.strip().isdigit() and int(text) > 0 else None


def thread_count(configured: int, env: Mapping[str, str], own_cores: list[int] | None, mask_cpus: int,
                 host_cpus: int, ranks_here: int, launcher_bound: bool | None) -> tuple[int, str]:
    """``threads_per_rank`` without the process: (threads, where the number came from).

    A scheduler that gives a job part of a node without binding it (Slurm with task/none) leaves
    the whole host in the affinity mask: the host's cores would then be another job's too, so the
    allocation's own number comes first. A mask narrower than the host is the job's cores: each
    rank's own where the launcher bound the ranks (``launcher_bound``, or srun's
    SLURM_CPU_BIND_TYPE), else shared by the host's ranks."""
    ranks_here = max(1, ranks_here)
    if configured > 0:
        return configured, "runtime.threads"
    usable = len(own_cores) if own_cores else (mask_cpus or host_cpus)
    per_task = positive(env.get("SLURM_CPUS_PER_TASK"))
    if per_task is not None:
        return min(per_task, usable), f"SLURM_CPUS_PER_TASK={per_task}"
    if own_cores:
        return len(own_cores), "its own cores"
    if 0 < mask_cpus < host_cpus:
        if launcher_bound is None:
            bind = env.get("SLURM_CPU_BIND_TYPE", "")
            launcher_bound = bool(bind) and not bind.startswith("none")
        if launcher_bound or ranks_here == 1:
            return mask_cpus, f"its affinity mask of {mask_cpus} CPUs"
        return max(1, mask_cpus // ranks_here), f"the affinity mask's {mask_cpus} CPUs / {ranks_here} ranks here"
    omp = positive(env.get("OMP_NUM_THREADS"))
    if omp is not None:
        return omp, f"OMP_NUM_THREADS={omp}"
    return max(1, host_cpus // ranks_here), f"the host's {host_cpus} CPUs / {ranks_here} ranks here"


def build_peers(elastic: bool) -> tuple[LivenessService, list[Peer]]:
    """Every rank's address, liveness port and token, known to every rank, to name a lost one later.
    (Elastic runs leave lost workers to Horovod Elastic instead.)

    The service listens where the other ranks reach this one (loopback when they all share this
    host); its token travels with the address in the allgather, never on a command line."""
    liveness = LivenessService(dist.rank(), listen_addresses(one_host=dist.cross_size() == 1))
    if elastic:
        return liveness, []
    return liveness, [Peer(**info) for info in dist.allgather_object(liveness.describe(), name="hvdtrain.peers")]


def build_loaders(cfg: Config, task: Task, device: torch.device,
                  evaluating: bool = False) -> tuple[Loaders, int, int]:
    """The task's loaders; the steps per epoch and the global batch they give. ``evaluating`` (a
    checkpoint's validation, on any number of ranks): training's batch settings are not checked
    against this world; the per-rank batch the checkpoint recorded is the validation batch."""
    elastic = cfg.elastic.enabled
    if not evaluating:
        resolve_batch_size(cfg, dist.size())
    env = DataEnv(rank=dist.rank(), world_size=dist.size(), pin_memory=device.type == "cuda",
                  broadcast_object=None if elastic else dist.broadcast_object,
                  allgather=None if elastic else dist.allgather,
                  local_rank_zero_first=contextlib.nullcontext if elastic else dist.local_rank_zero_first,
                  keep_partial_batches=elastic or not cfg.train.drop_last, device=device,
                  ranks_on_host=dist.local_size() if dist.initialized() else 1)
    loaders = task.build_loaders(env)
    passes = cfg.train.backward_passes_per_step
    steps_per_epoch = len(loaders.train) // passes
    if cfg.train.steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, cfg.train.steps_per_epoch)
    if steps_per_epoch == 0 and evaluating:
        steps_per_epoch = 1  # no step is taken; the schedule only needs a length
    if steps_per_epoch == 0:
        raise DataError(f"the training split has {loaders.train_size} samples: too few for one step of "
                        f"{dist.size()} ranks x {cfg.train.batch_size} samples x {passes} passes "
                        f"(lower train.batch_size or use fewer ranks)")
    return loaders, steps_per_epoch, cfg.train.batch_size * dist.size() * passes


def last_batch_note(cfg: Config, loaders: Loaders, world_size: int) -> str:
    """What happens to the epoch's last partial batch, for the start-up line: '' when there is none
    (or the loader says nothing of its length), else kept (train.drop_last=false) or left out."""
    sampler, batch = loaders.train_sampler, cfg.train.batch_size
    if not isinstance(sampler, ShardedSampler) or not sampler.pad:
        return ""
    per_rank = len(sampler)
    if not per_rank % batch or cfg.train.steps_per_epoch:
        return ""
    if not cfg.train.drop_last:
        padded = per_rank * world_size - loaders.train_size
        return (f" (the last one {per_rank % batch}/rank x {world_size} ranks: train.drop_last=false"
                + (f", {padded} sample(s) seen twice to even out the ranks)" if padded else ")"))
    return f" ({(per_rank % batch) * world_size} samples of the last partial batch left out: train.drop_last=true)"


def resolve_batch_size(cfg: Config, world_size: int) -> None:
    """``train.global_batch_size`` -> ``train.batch_size`` for ``world_size`` ranks (in place, before the
    task reads it). An explicit ``train.batch_size`` that disagrees, or a global batch the ranks and
    passes do not divide, stops with one line. (An explicit batch size equal to the default cannot be
    told from the default, and yields to the global one.)"""
    cfg.train.batch_size = per_rank_batch(cfg.train, world_size)


def build_model(cfg: Config, task: Task, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    model = task.build_model()
    if cfg.model.sync_bn:
        model = convert_sync_batchnorm(model, cuda=device.type == "cuda")
    # Parameters stay contiguous: Horovod refuses to broadcast or allreduce a channels_last tensor
    # ("Tensor is required to be contiguous"). The inputs are channels_last on the GPU
    # (DeviceNormalizer), and a convolution with a channels_last input runs channels_last.
    model = model.to(device, dtype=dtype)
    # After the SyncBN conversion (new modules, new parameters) and before the optimizer is built.
    frozen = apply_freeze(model, cfg.model.freeze, cfg.model.arch)
    if frozen:
        dist.log(f"hvdtrain: {frozen}")
    if cfg.runtime.compile:
        # Module.compile() compiles forward in place: parameter names and state-dict keys stay
        # unprefixed, so the optimizer, broadcasts and checkpoints are unchanged.
        model.compile()
    return model


def compression_for(cfg: Config, device: torch.device) -> str:
    if cfg.dist.compression == "auto":
        return "fp16" if device.type == "cuda" else "none"
    return cfg.dist.compression


def has_sparse_gradients(model: torch.nn.Module) -> bool:
    """Whether ``model`` makes sparse gradients (an embedding built with ``sparse=True``)."""
    return any(getattr(module, "sparse", False) for module in model.modules()
               if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)))


def bucket_mb_for(cfg: Config, device: torch.device, sparse: bool = False) -> float:
    """dist.bucket_mb resolved: auto is DDP's 25 MB on CPU (measured faster under Gloo,
    benchmarks/results/gloo-gap_amd-epyc-2core_2026-11-24.md) and Horovod's per-cycle fusion on
    GPU. Sparse gradients (``sparse``) take no groups (Horovod's grouped allreduce refuses them, made
    dense or not), and neither do elastic runs (validate() refuses an explicit size there)."""
    if sparse or cfg.elastic.enabled or cfg.dist.gradient_predivide_factor != 1:
        return 0
    if cfg.dist.bucket_mb == -1:
        return 25 if device.type == "cpu" else 0
    return cfg.dist.bucket_mb


def build_optimizer(cfg: Config, model: torch.nn.Module, schedule: LRSchedule,
                    device: torch.device, task: Task | None = None) -> torch.optim.Optimizer:
    """The task's own optimizer (``Task.build_optimizer``) or the one ``optim.name`` names, wrapped
    in Horovod's ``DistributedOptimizer``."""
    own = task.build_optimizer(model) if task is not None else None
    return dist.distributed_optimizer(
        own if own is not None else build_named_optimizer(model, cfg.optim, schedule(0)), model.named_parameters(),
        compression=compression_for(cfg, device), backward_passes_per_step=cfg.train.backward_passes_per_step,
        op=cfg.dist.op, sparse_as_dense=cfg.dist.sparse_as_dense,
        bucket_mb=bucket_mb_for(cfg, device, has_sparse_gradients(model)),
        gradient_predivide_factor=cfg.dist.gradient_predivide_factor)


def build_scaler(cfg: Config, device: torch.device) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    """The autocast dtype and, for float16, the GradScaler."""
    if not cfg.amp.enabled:
        return None, None
    if cfg.amp.dtype == "float16":
        return torch.float16, torch.amp.GradScaler(device.type)
    return torch.bfloat16, None


def lr_batch(op: str, global_batch: int, size: int, local_size: int, gpu_adasum: bool) -> int:
    """The batch the learning rate is scaled for (optim.base_lr is per 256 images): the global batch,
    but under Adasum one rank's (Horovod's example: no scaling by the number of ranks, since Adasum
    combines the ranks' updates rather than averaging their gradients); a host's with GPU Adasum over
    NCCL, which reduces within each host with NCCL and between hosts with Adasum (the example scales by
    the ranks per host there)."""
    if op != "adasum":
        return global_batch
    return global_batch // size * (local_size if gpu_adasum else 1)


AUTO_WORKERS = 4  # data.workers=-1 on a host with cores to spare


def auto_workers(own_cores: list[int] | None, env: Mapping[str, str], mask_cpus: int,
                 ranks_here: int) -> tuple[int, str]:
    """data.workers=-1: (loader workers per rank, the start-up line's why): 4, but no more than the
    rank's cores (its own, SLURM_CPUS_PER_TASK, or the affinity mask's / the host's ranks): 4 workers
    for each of 2 loaders beside 2 ranks on 2 cores are 16 processes on them."""
    cores = len(own_cores) if own_cores else positive(env.get("SLURM_CPUS_PER_TASK"))
    if cores is None:
        cores = max(1, mask_cpus // max(1, ranks_here))
    workers = min(AUTO_WORKERS, cores)
    return workers, (f"data.workers auto: {workers} per loader of each rank ({AUTO_WORKERS}, at most its "
                     f"{cores} core(s))")
