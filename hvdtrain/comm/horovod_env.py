"""The environment Horovod and Open MPI start from: hvdtrain's defaults per device and controller,
the settings an elastic run cannot survive, and the stall inspector's variables. Read by every rank
at ``hvd.init`` (dist.init applies them); no Horovod import here.
"""

from __future__ import annotations

import os

from ..config import ConfigError

# Horovod and Open MPI settings hvdtrain starts from, by device; a variable already in the
# environment always wins (os.environ.setdefault), so users and launchers can override any of them.
# Why, in short (README "Performance defaults" has the measurements):
# - HOROVOD_CYCLE_TIME (ms between background-thread cycles; Horovod's default is 1). Every cycle
#   is a cross-rank coordination round. On CPU a step takes hundreds of milliseconds, and a round
#   every millisecond costs more than it saves: it wakes the background thread 1000 times a second
#   on cores that torch is already using, and under the MPI controller each round is an MPI
#   collective whose wait busy-polls. Longer cycles also fuse more gradients per allreduce.
#   On GPU, steps are milliseconds long and NCCL runs on the device: keep the short cycle.
# - OMPI_MCA_mpi_yield_when_idle: Open MPI spins at full speed in a blocking call unless it sees the
#   host oversubscribed; with torch's threads on every core a spinning rank steals time from the
#   compute of its own and the other ranks. Yielding gives the core back while waiting.
# - HOROVOD_CYCLE_WAKE_ON_ENQUEUE (third_party/horovod/0003; Gloo controller only): start
#   a cycle as soon as a gradient group arrives instead of sleeping out the cycle, and at once after
#   a cycle that left tensors waiting for another rank (its coordination round then waits asleep
#   until that rank is ready). The up to 20 ms the cycle added at the end of backward go.
#   Not under MPI, whose coordination round would poll while it waits.
CPU_ENV_DEFAULTS = {
    "HOROVOD_CYCLE_TIME": "20",
    "OMPI_MCA_mpi_yield_when_idle": "1",
}
CPU_GLOO_ENV_DEFAULTS = {
    "HOROVOD_CYCLE_WAKE_ON_ENQUEUE": "1",
}
GPU_ENV_DEFAULTS: dict[str, str] = {}

# Not in elastic runs. In Horovod 0.28.1 a fixed cycle time breaks re-initialization in the same
# process (what hvd.elastic.run does after every membership change): ParameterManager's
# BayesianParameter drops a fixed variable from its index map, and the next init's default
# SetCycleTimeMs(1) then writes its 1 into the slot of the fusion threshold. Workers that were
# re-initialized fuse gradients up to 1 MB, a worker that has just joined up to 128 MB; where
# the response cache lets each rank fuse locally they build different buffers, and Gloo aborts
# the newcomer with "op.preamble.length <= op.nbytes". (Seen in this repository's elastic test.)
ELASTIC_UNSAFE_ENV = "HOROVOD_CYCLE_TIME"
# Set by horovodrun for ranks that will use the Gloo controller.
GLOO_RENDEZVOUS = "HOROVOD_GLOO_RENDEZVOUS_ADDR"


def apply_env_defaults(gpu: bool, elastic: bool = False) -> dict[str, str]:
    """Set hvdtrain's defaults for variables the environment leaves unset; returns the effective values."""
    defaults = dict(GPU_ENV_DEFAULTS if gpu else CPU_ENV_DEFAULTS)
    if not gpu and GLOO_RENDEZVOUS in os.environ:
        defaults.update(CPU_GLOO_ENV_DEFAULTS)
    if elastic:
        defaults.pop(ELASTIC_UNSAFE_ENV, None)
    for key, value in defaults.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in defaults}


def check_elastic_env() -> None:
    """Refuse settings that Horovod Elastic cannot survive, before any worker starts training."""
    if ELASTIC_UNSAFE_ENV in os.environ:
        raise ConfigError(
            f"{ELASTIC_UNSAFE_ENV}={os.environ[ELASTIC_UNSAFE_ENV]} is set, and with elastic.enabled=true Horovod "
            "0.28.1 then loses its fusion threshold whenever workers re-initialize, so a worker that joins "
            f"crashes the job; unset {ELASTIC_UNSAFE_ENV} (and leave out horovodrun --cycle-time-ms) for elastic runs")


STALL_VARIABLES = ("HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS",
                   "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")


def apply_stall_inspector(warning_seconds: int, shutdown_seconds: int) -> str:
    """The stall inspector's variables for ``dist.stall_warning_seconds`` and ``dist.stall_shutdown_seconds``,
    unless some are exported (``horovodrun --stall-check-*``, ``--no-stall-check``, the user's own):
    then the exported ones are the inspector's settings, as every other Horovod variable the user
    exports wins over hvdtrain's, and none is set. Returns the start-up line that names what the
    config asked for and did not get ('' when nothing differs)."""
    wanted = stall_inspector_env(warning_seconds, shutdown_seconds)
    exported = {key: os.environ[key] for key in STALL_VARIABLES if key in os.environ}
    if not exported:
        os.environ.update(wanted)
        return ""
    if all(exported.get(key) == value for key, value in wanted.items()):
        return ""
    return (f"hvdtrain: Horovod's stall inspector as exported ({', '.join(f'{k}={v}' for k, v in exported.items())}), "
            f"not as dist.stall_warning_seconds={warning_seconds}, dist.stall_shutdown_seconds={shutdown_seconds} "
            "would set it: unset those variables for the config's")


def stall_inspector_env(warning_seconds: int, shutdown_seconds: int) -> dict[str, str]:
    """Horovod's variables for the stall inspector (read by every rank at ``hvd.init``)."""
    if warning_seconds <= 0:
        return {"HOROVOD_STALL_CHECK_DISABLE": "1"}
    return {"HOROVOD_STALL_CHECK_DISABLE": "0", "HOROVOD_STALL_CHECK_TIME_SECONDS": str(warning_seconds),
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": str(shutdown_seconds)}
