"""Horovod environment defaults: set per device before hvd.init(), never over the user's values."""

from __future__ import annotations

import os

from hvdtrain import dist


def test_cpu_defaults_fill_only_unset_variables(monkeypatch):
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    effective = dist.apply_env_defaults(gpu=False)
    assert effective == {"HOROVOD_CYCLE_TIME": "3", "OMPI_MCA_mpi_yield_when_idle": "1"}


def test_gpu_keeps_horovods_own_defaults(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    dist.apply_env_defaults(gpu=True)
    assert "HOROVOD_CYCLE_TIME" not in os.environ
    assert "OMPI_MCA_mpi_yield_when_idle" not in os.environ
