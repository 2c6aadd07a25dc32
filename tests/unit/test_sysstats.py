"""The statistics sampler on real CPU load: a busy main thread, busy and short-lived child
processes. The GPU path is checked for staying silent without NVML, and its plumbing on a stand-in
pynvml module (CI has no GPU)."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
import types
import warnings

import psutil
import pytest

from hvdtrain.observe.sysstats import KEYS, StatsSampler, across_ranks, nvml_device_id, summarize_samples

GPU_KEYS = {"gpu_util_percent", "gpu_mem_used_gib", "gpu_mem_total_gib", "gpu_power_w"}
BUSY_CHILD = [sys.executable, "-c", "while True: pass"]


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture(autouse=True)
def no_shared_ranks():
    """The sampler counts every child of this process: the suite's shared ranks (children of a
    pytest process that ran launched tests before) poll in Horovod's background loop and would be
    counted as busy workers."""
    from tests import shared_ranks
    shared_ranks.stop_all()


@pytest.fixture
def busy_child():
    child = subprocess.Popen(BUSY_CHILD)
    yield child
    child.kill()
    child.wait()


def test_summarize_canned_samples():
    samples = [
        {"cpu_percent": 90.0, "workers_cpu_percent": 300.0, "rss_gib": 2.0, "gpu_power_w": None},
        {"cpu_percent": 110.0, "workers_cpu_percent": 100.0, "rss_gib": 4.0, "gpu_power_w": 250.0},
        {"cpu_percent": None, "workers_cpu_percent": None, "rss_gib": 3.0, "gpu_util_percent": 97.0},
    ]
    result = summarize_samples(samples)
    assert result["cpu_percent"] == 100.0            # the None is skipped, not counted as 0
    assert result["workers_cpu_percent"] == 200.0
    assert result["rss_gib"] == 3.0
    assert result["gpu_power_w"] == 250.0           # one reading of two: a board without power
    assert result["gpu_util_percent"] == 97.0       # a key present in one sample only
    assert result["stats_samples"] == 3
    # A ratio of means, 200 / 300, not the mean of the per-sample ratios (0.77 and 0.48).
    assert result["workers_cpu_share"] == pytest.approx(2 / 3)
    assert list(result) == [key for key in KEYS if key in result]   # a fixed order for the record


def test_summarize_leaves_out_what_no_sample_had():
    result = summarize_samples([{"rss_gib": 1.0, "gpu_power_w": None}])
    assert result == {"rss_gib": 1.0, "stats_samples": 1}
    assert summarize_samples([]) == {"stats_samples": 0}


# The machine may be shared (CI, other test runs): a busy loop can get well under one core. So
# each test compares the sampler's figure with the CPU time the OS reports for the same stretch,
# and asks for a floor that an idle process could not reach.


def existing_children() -> int:
    """Children this test process already has (e.g. the orted that an in-process MPI init starts
    in an earlier test): they are workers to the sampler too."""
    return len(psutil.Process().children(recursive=True))


def test_busy_main_thread():
    existing = existing_children()
    sampler = StatsSampler(interval=0.05)            # its first window starts here
    cpu_s, started = time.process_time(), time.monotonic()
    with sampler:
        burn(0.8)
        stats = sampler.take_epoch()
        truth = 100 * (time.process_time() - cpu_s) / (time.monotonic() - started)
    assert stats["stats_samples"] >= 3  # every 0.05 s over 0.8 s, less when the machine is loaded
    assert stats["cpu_percent"] == pytest.approx(truth, rel=0.25)
    assert 20 < stats["cpu_percent"] < 150           # one busy thread: at most about one core
    assert 0.001 < stats["rss_gib"] < 64
    assert stats["workers_count"] == existing and stats["workers_cpu_percent"] < 5
    assert not GPU_KEYS & stats.keys()


def child_cpu_percent(child: subprocess.Popen, since: float) -> float:
    times = psutil.Process(child.pid).cpu_times()
    return 100 * (times.user + times.system) / (time.monotonic() - since)


def wait_for_cpu_seconds(child: subprocess.Popen, seconds: float, deadline: float = 60) -> None:
    """Until ``child`` has used ``seconds`` of CPU (an event, not a span of wall time)."""
    guard = time.monotonic() + deadline
    while sum(psutil.Process(child.pid).cpu_times()[:2]) < seconds:
        assert time.monotonic() < guard, f"the busy child got under {seconds} s of CPU in {deadline} s"
        time.sleep(0.05)


def test_busy_worker_started_after_the_sampler():
    with StatsSampler(interval=0.05, scan_interval=0.2) as sampler:
        started = time.monotonic()
        child = subprocess.Popen(BUSY_CHILD)
        try:
            # At least four scans, and until the child has had 0.3 s of CPU: on a loaded machine it
            # may get a tenth of a core, and a share that small would prove little.
            time.sleep(0.8)
            wait_for_cpu_seconds(child, 0.3)
            stats = sampler.take_epoch()
            truth = child_cpu_percent(child, started)  # all of its CPU time is in the epoch
        finally:
            child.kill()
            child.wait()
    assert stats["workers_count"] >= 0.5             # seen from the first scan after its start
    # Found up to 0.2 s late, yet none of its CPU time is lost.
    assert stats["workers_cpu_percent"] == pytest.approx(truth, rel=0.25)
    # The main thread only slept; starting the child and the sampler's scans cost a little (10.2%
    # once in CI on a busy machine), far below the child's share.
    assert stats["cpu_percent"] < 25
    assert stats["workers_cpu_share"] > 0.7
    assert stats["workers_rss_gib"] > 0.001


def test_busy_worker_started_before_the_sampler(busy_child):
    existing = existing_children() - 1
    time.sleep(0.2)                                  # CPU time from before the sampler must not count
    before = psutil.Process(busy_child.pid).cpu_times()
    with StatsSampler(interval=0.05, scan_interval=0.2) as sampler:
        started = time.monotonic()
        time.sleep(0.6)
        wait_for_cpu_seconds(busy_child, before.user + before.system + 0.2)  # 0.2 s of CPU in the epoch
        stats = sampler.take_epoch()
        now = psutil.Process(busy_child.pid).cpu_times()
        truth = 100 * (now.user + now.system - before.user - before.system) / (time.monotonic() - started)
    assert stats["workers_count"] == 1 + existing
    assert stats["workers_cpu_percent"] == pytest.approx(truth, rel=0.25)


def test_workers_that_come_and_go(caplog):
    """Short-lived children exit between being listed and being read, or between samples, and a
    zombie (exited, not yet reaped) is listed: none of it may break a sample."""
    caplog.set_level(logging.DEBUG, logger="hvdtrain.observe.sysstats")
    existing = existing_children()
    with StatsSampler(interval=0.01, scan_interval=0.0) as sampler:
        end = time.perf_counter() + 0.6
        while time.perf_counter() < end:
            subprocess.Popen([sys.executable, "-c", "pass"]).wait()
        zombie = subprocess.Popen([sys.executable, "-c", "pass"])
        time.sleep(0.2)                              # exited; not reaped until wait()
        during = sampler.take_epoch()
        zombie.wait()
        sampler.take_epoch()
        time.sleep(0.1)
        after = sampler.take_epoch()
    assert not [record for record in caplog.records if "sample failed" in record.message]
    assert during["stats_samples"] >= 5
    assert after["stats_samples"] >= 2 and after["workers_count"] == existing


def test_take_epoch_resets_and_is_never_empty():
    sampler = StatsSampler(interval=60)              # never started: take_epoch samples itself
    time.sleep(0.1)
    first = sampler.take_epoch()
    assert first["stats_samples"] == 1 and "cpu_percent" in first and "rss_gib" in first
    # Right after a sample the CPU window is too short to mean anything: memory only.
    second = sampler.take_epoch()
    assert second["stats_samples"] == 1 and "rss_gib" in second and "cpu_percent" not in second

    with StatsSampler(interval=0.05) as running:
        time.sleep(0.4)
        assert running.take_epoch()["stats_samples"] >= 2  # 8 at 0.05 s, fewer on a loaded machine
        assert running.take_epoch()["stats_samples"] <= 2


def test_stop_returns_promptly():
    sampler = StatsSampler(interval=30).start()
    time.sleep(0.05)
    started = time.perf_counter()
    sampler.stop()
    assert time.perf_counter() - started < 0.5       # not the 30 s interval
    assert sampler._thread is None
    sampler.take_epoch()                             # still answers after stop()
    with StatsSampler(interval=30):
        pass                                         # the context manager stops it too


@pytest.mark.parametrize("pynvml_module", ["missing", "init_fails"])
def test_no_gpu_fields_and_no_noise_without_nvml(monkeypatch, caplog, pynvml_module):
    if pynvml_module == "missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)   # `import pynvml` raises ImportError
    else:
        monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(init_error=True))
    caplog.set_level(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with StatsSampler(interval=0.05, gpu_index=0) as sampler:
            time.sleep(0.15)
            stats = sampler.take_epoch()
    assert not sampler.has_gpu and not GPU_KEYS & stats.keys()
    assert caught == [] and caplog.records == []


def test_no_gpu_fields_without_gpu_index(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml())
    sampler = StatsSampler(gpu_index=None)
    assert not sampler.has_gpu and not GPU_KEYS & sampler.take_epoch().keys()


def test_gpu_fields_from_nvml(monkeypatch):
    """The NVML plumbing on a stand-in module: units, the board without power, shutdown."""
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with StatsSampler(interval=0.05, gpu_index=1) as sampler:
        assert sampler.has_gpu and nvml.opened == [3]      # CUDA device 1 is the machine's GPU 3
        time.sleep(0.15)
        stats = sampler.take_epoch()
    assert stats["gpu_util_percent"] == 96.0
    assert stats["gpu_mem_used_gib"] == 30.0 and stats["gpu_mem_total_gib"] == 80.0
    assert "gpu_power_w" not in stats                      # NotSupported on every sample
    assert nvml.shutdowns == 1


def test_gpu_not_visible_to_cuda(monkeypatch):
    nvml = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    sampler = StatsSampler(gpu_index=0)
    assert not sampler.has_gpu and nvml.opened == [] and nvml.shutdowns == 1


def test_a_failing_sample_does_not_stop_the_sampler(monkeypatch, caplog):
    nvml = fake_pynvml()
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: 1 / 0      # not an NVMLError: a bug
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    with StatsSampler(interval=0.02, gpu_index=0) as sampler:
        time.sleep(0.2)
        assert sampler._thread.is_alive()
        sampler.take_epoch()
    warned = [record for record in caplog.records if record.levelno >= logging.WARNING]
    assert len(warned) == 1 and "sample failed" in warned[0].message   # once, not every sample


def test_nvml_device_id():
    assert nvml_device_id(1, None) == 1
    assert nvml_device_id(1, "4,6") == 6
    assert nvml_device_id(0, "GPU-8f2a") == "GPU-8f2a"     # a UUID prefix: matched against NVML's
    assert nvml_device_id(2, "4,6") is None                # not visible to CUDA
    assert nvml_device_id(0, "") is None
    assert nvml_device_id(0, "MIG-1c2d") is None


def fake_pynvml(init_error: bool = False) -> types.ModuleType:
    """A stand-in for nvidia-ml-py's pynvml: one 80 GiB GPU per index, 96% busy, 30 GiB used,
    power not supported."""
    nvml = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def init():
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")

    def handle_by_index(index):
        nvml.opened.append(index)
        return index

    def power(handle):
        raise NVMLError_NotSupported("Not Supported")

    def shutdown():
        nvml.shutdowns += 1

    nvml.NVMLError, nvml.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported
    nvml.opened, nvml.shutdowns = [], 0
    nvml.nvmlInit, nvml.nvmlShutdown = init, shutdown
    nvml.nvmlDeviceGetHandleByIndex = handle_by_index
    nvml.nvmlDeviceGetUtilizationRates = lambda handle: types.SimpleNamespace(gpu=96, memory=40)
    nvml.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(used=30 << 30, total=80 << 30)
    nvml.nvmlDeviceGetPowerUsage = power
    return nvml


def test_across_ranks_averages_and_keeps_the_least_busy_gpu():
    ranks = [{"cpu_percent": 100.0, "gpu_util_percent": 97.0, "stats_samples": 5.0},
             {"cpu_percent": 50.0, "gpu_util_percent": 81.0, "stats_samples": 4.0}, {"cpu_percent": 30.0}]
    assert across_ranks(ranks) == {"cpu_percent": 60.0, "gpu_util_percent": 89.0, "gpu_util_percent_min": 81.0}
    assert across_ranks([{"cpu_percent": 10.0}]) == {"cpu_percent": 10.0}
