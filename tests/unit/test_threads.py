"""runtime.threads=0: the allocation's CPUs per task, else the rank's own cores or its affinity
mask, else OMP_NUM_THREADS, before the host's cores (train/builders.thread_count); the start-up
line says where the number came from."""

from __future__ import annotations

import pytest

from hvdtrain.train.builders import thread_count


@pytest.mark.parametrize("configured, env, own, mask, launcher_bound, expected", [
    (3, {"SLURM_CPUS_PER_TASK": "8"}, None, 64, None, (3, "runtime.threads")),
    # Slurm with task/none: --cpus-per-task=1 on a 64-CPU host that every job's ranks see whole.
    (0, {"SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "4"}, None, 64, None, (1, "SLURM_CPUS_PER_TASK=1")),
    (0, {"SLURM_CPUS_PER_TASK": "8"}, [0, 1], 64, None, (2, "SLURM_CPUS_PER_TASK=8")),  # not past its own cores
    (0, {"OMP_NUM_THREADS": "1"}, [0, 1, 2, 3], 64, False, (4, "its own cores")),
    # srun --cpu-bind: each rank's mask is its own; a cpuset shared by the host's 2 ranks: halved.
    (0, {"SLURM_CPU_BIND_TYPE": "mask_cpu:"}, None, 8, None, (8, "its affinity mask of 8 CPUs")),
    (0, {}, None, 8, True, (8, "its affinity mask of 8 CPUs")),
    (0, {}, None, 8, None, (4, "the affinity mask's 8 CPUs / 2 ranks here")),
    (0, {"OMP_NUM_THREADS": "1"}, None, 64, None, (1, "OMP_NUM_THREADS=1")),
    (0, {"OMP_NUM_THREADS": "x", "SLURM_CPUS_PER_TASK": "0"}, None, 64, None,
     (32, "the host's 64 CPUs / 2 ranks here")),
])
def test_the_thread_count_follows_the_allocation_before_the_host(configured, env, own, mask, launcher_bound, expected):
    assert thread_count(configured, env, own, mask, 64, 2, launcher_bound) == expected


def test_auto_loader_workers_are_four_at_most_the_ranks_cores():
    """data.workers=-1 (the default): 4 workers for each of a rank's 2 loaders beside 2 ranks on a
    2-core host were 16 processes on 2 cores; the rank's share of the cores caps them now."""
    from hvdtrain.train.builders import auto_workers

    line = "data.workers auto: 1 per loader of each rank (4, at most its 1 core(s))"
    assert auto_workers(None, {}, 2, 2) == (1, line)                      # 2 cores, 2 ranks
    assert auto_workers(None, {}, 64, 8)[0] == 4                          # 8 cores per rank: 4
    assert auto_workers([0, 1, 2], {}, 64, 8)[0] == 3                     # its own cores
    assert auto_workers(None, {"SLURM_CPUS_PER_TASK": "2"}, 64, 8)[0] == 2
    from hvdtrain.config import ConfigError
    from hvdtrain.job_config import load_config

    assert load_config(None).data.workers == -1 and load_config("debug").data.workers == 0
    with pytest.raises(ConfigError, match=r"^config key 'data.workers' must be >= 0, or -1 for auto, got -2$"):
        load_config("debug", ["data.workers=-2"])
