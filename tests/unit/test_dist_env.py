"""Horovod environment defaults: set per device before hvd.init(), never over the user's values."""

from __future__ import annotations

import os

import pytest
import torch

from hvdtrain.comm import dist, horovod_engine, horovod_env
from hvdtrain.comm.buckets import gradient_buckets
from hvdtrain.config import ConfigError
from hvdtrain.job_config import load_config
from hvdtrain.train import builders


def test_cpu_defaults_fill_only_unset_variables(monkeypatch):
    monkeypatch.delenv(horovod_env.GLOO_RENDEZVOUS, raising=False)
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "3")
    effective = horovod_env.apply_env_defaults(gpu=False)
    assert effective == {"HOROVOD_CYCLE_TIME": "3", "OMPI_MCA_mpi_yield_when_idle": "1"}


def test_the_gloo_controller_on_cpu_asks_for_the_wake_on_enqueue_unless_exported(monkeypatch):
    """The setting alone; that a tensor then starts its cycle when it arrives is measured in a launched
    job: tests/parallel/test_observability.py::test_a_tensor_starts_its_cycle_when_it_arrives_under_gloo."""
    monkeypatch.delenv("HOROVOD_CYCLE_WAKE_ON_ENQUEUE", raising=False)
    monkeypatch.delenv(horovod_env.GLOO_RENDEZVOUS, raising=False)
    assert "HOROVOD_CYCLE_WAKE_ON_ENQUEUE" not in horovod_env.apply_env_defaults(gpu=False)   # MPI controller
    monkeypatch.setenv(horovod_env.GLOO_RENDEZVOUS, "127.0.0.1")
    assert "HOROVOD_CYCLE_WAKE_ON_ENQUEUE" not in horovod_env.apply_env_defaults(gpu=True)
    assert horovod_env.apply_env_defaults(gpu=False)["HOROVOD_CYCLE_WAKE_ON_ENQUEUE"] == "1"
    monkeypatch.setenv("HOROVOD_CYCLE_WAKE_ON_ENQUEUE", "0")
    assert horovod_env.apply_env_defaults(gpu=False)["HOROVOD_CYCLE_WAKE_ON_ENQUEUE"] == "0"


def test_gpu_keeps_horovods_own_defaults(monkeypatch):
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    horovod_env.apply_env_defaults(gpu=True)
    assert "HOROVOD_CYCLE_TIME" not in os.environ
    assert "OMPI_MCA_mpi_yield_when_idle" not in os.environ


def test_elastic_runs_keep_horovods_cycle_time(monkeypatch):
    monkeypatch.delenv(horovod_env.GLOO_RENDEZVOUS, raising=False)
    monkeypatch.delenv("HOROVOD_CYCLE_TIME", raising=False)
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    effective = horovod_env.apply_env_defaults(gpu=False, elastic=True)
    assert effective == {"OMPI_MCA_mpi_yield_when_idle": "1"}
    assert "HOROVOD_CYCLE_TIME" not in os.environ


def test_elastic_run_refuses_a_fixed_cycle_time_in_one_line(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    with pytest.raises(ConfigError) as error:
        horovod_env.check_elastic_env()
    message = str(error.value)
    assert "\n" not in message and "HOROVOD_CYCLE_TIME=5" in message and "unset HOROVOD_CYCLE_TIME" in message
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    horovod_env.check_elastic_env()


def test_stall_inspector_settings_become_horovods_variables():
    assert horovod_env.stall_inspector_env(30, 120) == {"HOROVOD_STALL_CHECK_DISABLE": "0",
                                                 "HOROVOD_STALL_CHECK_TIME_SECONDS": "30",
                                                 "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "120"}
    assert horovod_env.stall_inspector_env(0, 0) == {"HOROVOD_STALL_CHECK_DISABLE": "1"}


def test_exported_stall_inspector_variables_win_and_a_line_says_so(monkeypatch):
    """horovodrun's --stall-check-warning-time-seconds 5 --stall-check-shutdown-time-seconds 20
    export these; the config's 60/0 used to replace them."""
    for key in horovod_env.STALL_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    assert horovod_env.apply_stall_inspector(60, 0) == ""  # nothing exported: the config's
    assert {key: os.environ[key] for key in horovod_env.STALL_VARIABLES} == horovod_env.stall_inspector_env(60, 0)
    for key in horovod_env.STALL_VARIABLES:
        monkeypatch.delenv(key)
    monkeypatch.setenv("HOROVOD_STALL_CHECK_TIME_SECONDS", "5")
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "20")
    line = horovod_env.apply_stall_inspector(60, 0)
    assert line == ("hvdtrain: Horovod's stall inspector as exported (HOROVOD_STALL_CHECK_TIME_SECONDS=5, "
                    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=20), not as dist.stall_warning_seconds=60, "
                    "dist.stall_shutdown_seconds=0 would set it: unset those variables for the config's")
    assert (os.environ["HOROVOD_STALL_CHECK_TIME_SECONDS"], os.environ["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]) \
        == ("5", "20") and "HOROVOD_STALL_CHECK_DISABLE" not in os.environ
    monkeypatch.setenv("HOROVOD_STALL_CHECK_DISABLE", "1")  # --no-stall-check, and the config's 0 agrees
    monkeypatch.delenv("HOROVOD_STALL_CHECK_TIME_SECONDS")
    monkeypatch.delenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    assert horovod_env.apply_stall_inspector(0, 0) == ""


def test_every_horovod_variable_hvdtrain_sets_leaves_an_exported_value(monkeypatch):
    """The audit: what the ranks set before hvd.init (the device defaults, the Gloo timeout, the
    timeline, the stall inspector) keeps a value the user exported."""
    exported = {"HOROVOD_CYCLE_TIME": "7", "OMPI_MCA_mpi_yield_when_idle": "0", "HOROVOD_GLOO_TIMEOUT_SECONDS": "40",
                "HOROVOD_TIMELINE": "/tmp/own.json", "HOROVOD_STALL_CHECK_TIME_SECONDS": "9",
                "HOROVOD_CYCLE_WAKE_ON_ENQUEUE": "0"}
    for key in horovod_env.STALL_VARIABLES:
        monkeypatch.delenv(key, raising=False)
    for key, value in exported.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(horovod_env.GLOO_RENDEZVOUS, "127.0.0.1")
    monkeypatch.setattr(horovod_engine.hvd, "is_initialized", lambda: False)
    monkeypatch.setattr(horovod_engine.hvd, "init", lambda: None)
    monkeypatch.setattr(horovod_engine.hvd, "rank", lambda: 0)
    monkeypatch.setattr(horovod_engine.launcher, "hostname_problem", lambda: None)
    horovod_engine.init(gpu=False, timeout_seconds=600, stall_warning_seconds=60, stall_shutdown_seconds=0,
                        timeline=True)
    assert {key: os.environ[key] for key in exported} == exported
    assert "HOROVOD_STALL_CHECK_DISABLE" not in os.environ and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in os.environ


def test_an_unresolvable_hostname_stops_a_gloo_rank_before_horovod_starts(monkeypatch):
    monkeypatch.setenv(horovod_env.GLOO_RENDEZVOUS, "127.0.0.1")
    monkeypatch.setattr(horovod_engine.launcher.socket, "gethostname", lambda: "no-such-host.invalid")
    monkeypatch.setattr(horovod_engine.hvd, "is_initialized", lambda: False)
    monkeypatch.setattr(horovod_engine.hvd, "init", lambda: pytest.fail("hvd.init() ran"))
    with pytest.raises(ConfigError, match="this host's name 'no-such-host.invalid' does not resolve"):
        dist.init(gpu=False)


def test_gradient_buckets_follow_backward_order_and_skip_frozen_parameters():
    # resnet-like sizes in registration order: the last layers' gradients come first in backward.
    sizes = [1000, 10, 10, 250_000, 10, 10, 500_000, 2000]          # float32 elements
    parameters = [torch.nn.Parameter(torch.zeros(n)) for n in sizes]
    parameters[1].requires_grad_(False)
    buckets = gradient_buckets(parameters, bucket_mb=1.0)      # 1 MB = 250,000 float32
    assert [[p.numel() for p in bucket] for bucket in buckets] == [[2000, 500_000], [10, 10, 250_000], [10, 1000]]
    assert all(p.requires_grad for bucket in buckets for p in bucket)
    one = gradient_buckets(parameters, bucket_mb=100)
    assert len(one) == 1 and len(one[0]) == 7


@pytest.mark.parametrize("overrides, device, expected", [
    ([], "cpu", 25), ([], "cuda", 0), (["dist.bucket_mb=8"], "cuda", 8), (["dist.bucket_mb=0"], "cpu", 0),
    (["elastic.enabled=true"], "cpu", 0),
])
def test_bucket_size_auto_is_ddps_on_cpu_and_off_on_gpu_for_sparse_gradients_and_elastic_runs(
        overrides, device, expected):
    assert builders.bucket_mb_for(load_config(None, overrides), torch.device(device)) == expected
    # A model that makes sparse gradients (a recommender with recommendation.sparse_embeddings) takes no groups.
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
    assert builders.has_sparse_gradients(sparse) and not builders.has_sparse_gradients(torch.nn.Linear(4, 1))
    assert builders.bucket_mb_for(load_config(None, overrides), torch.device(device), sparse=True) == 0
