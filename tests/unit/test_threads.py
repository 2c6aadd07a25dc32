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
