"""Horovod environment defaults: set per device before hvd.init(), never over the user's values."""

from __future__ import annotations

import os

import pytest

from hvdtrain import dist
from hvdtrain.config import ConfigError


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


def test_elastic_runs_keep_horovods_cycle_time(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    effective = dist.apply_env_defaults(gpu=False, elastic=True)
    assert effective == {"OMPI_MCA_mpi_yield_when_idle": "1"}
    assert "HOROVOD_CYCLE_TIME" not in os.environ


def test_elastic_run_refuses_a_fixed_cycle_time_in_one_line(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    with pytest.raises(ConfigError) as error:
        dist.check_elastic_env()
    message = str(error.value)
    assert "\n" not in message and "HOROVOD_CYCLE_TIME=5" in message and "unset HOROVOD_CYCLE_TIME" in message
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    dist.check_elastic_env()


def test_stall_inspector_settings_become_horovods_variables():
    assert dist.stall_inspector_env(30, 120) == {"HOROVOD_STALL_CHECK_DISABLE": "0",
                                                 "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
                                                 "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}
    assert dist.stall_inspector_env(0, 0) == {"HOROVOD_STALL_CHECK_DISABLE": "1"}


def test_an_unresolvable_hostname_stops_a_gloo_rank_before_horovod_starts(monkeypatch):
    monkeypatch.setenv(dist.GLOO_RENDEZVOUS, "127.0.0.1")
    monkeypatch.setattr(dist.launcher.socket, "gethostname", lambda: "no-such-host.invalid")
    monkeypatch.setattr(dist.hvd, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.hvd, "init", lambda: pytest.fail("hvd.init() ran"))
    with pytest.raises(ConfigError, match="this host's name 'no-such-host.invalid' does not resolve"):
        dist.init(gpu=False)
