"""GPU and host statistics of one rank, sampled in a background thread and averaged per epoch.

The question they answer is "is this rank's GPU kept busy, and if not, is the host the reason?"
The usual rule of thumb is every GPU above 95% busy; below that, the CPU figures say whether the
training process or its data-loader workers are saturated.

Every machine: the training process's CPU (100 = one full core, psutil's convention) and resident
memory, and the same summed over its descendants: the DataLoader workers, and with a forkserver
context also the (idle) fork server and resource tracker. With a GPU index and NVML (the
``nvidia-ml-py`` package, imported as ``pynvml``): the GPU's utilization, memory and power.
Without NVML, or with no GPU index, the GPU fields are left out silently: a CPU-only run is normal.

    with StatsSampler(interval=1.0, gpu_index=local_rank) as stats:
        for epoch in ...:
            engine.Epoch(...)
            record.update(stats.take_epoch())
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from typing import Any, Iterable, Mapping

import psutil

log = logging.getLogger(__name__)

GIB = float(1 << 30)
# The fields of take_epoch(), in the order they are written; the gpu_ ones only with NVML.
KEYS = ("cpu_percent", "rss_gib", "workers_count", "workers_cpu_percent", "workers_rss_gib",
        "workers_cpu_share", "gpu_util_percent", "gpu_mem_used_gib", "gpu_mem_total_gib",
        "gpu_power_w", "stats_samples")
# A CPU percentage over a shorter window is mostly rounding: the kernel counts CPU time in clock
# ticks of 10 ms. A shorter window is left out and its time is counted in the next sample.
MIN_CPU_WINDOW_S = 0.05


# ---------------------------------------------------------------------------------------------
# Averaging (pure)


class SampleMeans:
    """Running means of samples, key by key; a None value (a reading that failed or was not
    available) is left out of its key's mean, not counted as zero."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}
        self.samples = 0

    def add(self, sample: Mapping[str, float | None]) -> None:
        self.samples += 1
        for key, value in sample.items():
            if value is None:
                continue
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1

    def means(self) -> dict[str, float]:
        return {key: total / self.counts[key] for key, total in self.sums.items()}


def summarize_samples(samples: Iterable[Mapping[str, float | None]]) -> dict[str, float]:
    """The means of ``samples`` (every key present in any sample, None values skipped), the
    workers' share of the rank's CPU, and ``stats_samples``, the number of samples."""
    means = SampleMeans()
    for sample in samples:
        means.add(sample)
    return _summary(means)


def _summary(means: SampleMeans) -> dict[str, float]:
    result: dict[str, Any] = means.means()
    # The share is a ratio of means (CPU time of the workers over that of the whole rank), not a
    # mean of per-sample ratios, which would weigh an idle moment as much as a busy one.
    main, workers = result.get("cpu_percent"), result.get("workers_cpu_percent")
    if main is not None and workers is not None and main + workers > 0:
        result["workers_cpu_share"] = workers / (main + workers)
    result["stats_samples"] = means.samples
    # The same order every epoch, whichever sample happened to have a field first.
    order = {key: index for index, key in enumerate(KEYS)}
    return dict(sorted(result.items(), key=lambda item: order.get(item[0], len(KEYS))))


# ---------------------------------------------------------------------------------------------
# CPU and memory of the process and its descendants (psutil)


def _cpu_seconds(times: Any) -> float:
    return times.user + times.system  # the process's own threads, not its reaped children


class _ProcessReader:
    """CPU percentages as CPU seconds used since the previous sample over the wall seconds since
    then, for the process and for its descendants.

    Finding the descendants means reading every process of the machine (about 35 us each), so it
    is done every ``scan_interval`` seconds and at the end of each epoch; between scans the known
    workers are read directly. A worker found late loses nothing: all of its CPU time so far
    counts in the sample that finds it, so the epoch's mean is right even if that sample is not.
    """

    def __init__(self, process: psutil.Process, scan_interval: float):
        self.process = process
        self.scan_interval = scan_interval
        self.last_at = time.monotonic()  # the start of the current window
        self.main_cpu_s = _cpu_seconds(process.cpu_times())
        self.children: dict[psutil.Process, float] = {}  # CPU seconds at the start of the window
        self.next_scan = 0.0
        self._scan(first=True)

    def _scan(self, first: bool = False) -> None:
        try:
            found = self.process.children(recursive=True)
        except psutil.Error:
            found = []
        children: dict[psutil.Process, float] = {}
        for child in found:  # psutil.Process compares by pid and start time: a reused pid is new
            if child in self.children:
                children[child] = self.children[child]
            elif first:  # there before the sampler: count from now on
                try:
                    children[child] = _cpu_seconds(child.cpu_times())
                except psutil.Error:
                    pass
            else:  # started since the last scan: all its CPU time is new
                children[child] = 0.0
        self.children = children
        self.next_scan = time.monotonic() + self.scan_interval

    def read(self, scan: bool = False) -> dict[str, float | None]:
        now = time.monotonic()
        with self.process.oneshot():
            main_cpu_s, rss = _cpu_seconds(self.process.cpu_times()), self.process.memory_info().rss
        if scan or now >= self.next_scan:
            self._scan()

        workers_cpu_s: dict[psutil.Process, float] = {}
        workers_rss = 0
        for child in list(self.children):
            try:
                with child.oneshot():
                    workers_cpu_s[child] = _cpu_seconds(child.cpu_times())
                    workers_rss += child.memory_info().rss
            except psutil.Error:  # NoSuchProcess (the worker exited), ZombieProcess, AccessDenied
                workers_cpu_s.pop(child, None)
                del self.children[child]

        sample: dict[str, float | None] = {
            "cpu_percent": None,
            "rss_gib": rss / GIB,
            "workers_count": len(workers_cpu_s),
            "workers_cpu_percent": None,
            # Shared pages (copy-on-write after fork, shared-memory tensors) count once in every
            # process that maps them, so this sum can exceed what the workers really cost.
            "workers_rss_gib": workers_rss / GIB,
        }
        window = now - self.last_at
        if window >= MIN_CPU_WINDOW_S:  # else no CPU figures; the window goes on
            used = sum(max(cpu_s - self.children[child], 0.0) for child, cpu_s in workers_cpu_s.items())
            sample["cpu_percent"] = 100.0 * max(main_cpu_s - self.main_cpu_s, 0.0) / window
            sample["workers_cpu_percent"] = 100.0 * used / window
            self.last_at, self.main_cpu_s = now, main_cpu_s
            self.children.update(workers_cpu_s)
        return sample


# ---------------------------------------------------------------------------------------------
# GPU (NVML)


def nvml_device_id(gpu_index: int, visible_devices: str | None) -> int | str | None:
    """NVML's id of CUDA device ``gpu_index``: NVML numbers every GPU of the machine, CUDA only
    those in CUDA_VISIBLE_DEVICES (``visible_devices``). An index (int), a UUID or UUID prefix
    (str), or None where the device cannot be named (not visible, MIG instance, malformed)."""
    if visible_devices is None:
        return gpu_index
    entries = [entry.strip() for entry in visible_devices.split(",")]
    if gpu_index >= len(entries) or not entries[gpu_index]:
        return None
    entry = entries[gpu_index]
    if entry.isdigit():
        return int(entry)
    if entry.startswith("GPU-"):
        return entry
    return None


class _NvmlReader:
    """Utilization, memory and power of one GPU. A reading the GPU does not support (power on
    some boards, utilization on MIG instances) is None, silently."""

    def __init__(self, nvml: Any, handle: Any):
        self.nvml = nvml
        self.handle = handle

    @classmethod
    def open(cls, gpu_index: int) -> _NvmlReader | None:
        """None, with a single debug line, where there is no NVML or no such GPU."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the old `pynvml` wrapper warns on import
                import pynvml
        except ImportError:
            log.debug("GPU statistics off: pynvml (nvidia-ml-py) is not installed")
            return None
        try:
            pynvml.nvmlInit()
        except Exception as error:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
            log.debug("GPU statistics off: NVML did not start (%s)", error)
            return None
        try:
            device = nvml_device_id(gpu_index, os.environ.get("CUDA_VISIBLE_DEVICES"))
            handle = None
            if isinstance(device, int):
                handle = pynvml.nvmlDeviceGetHandleByIndex(device)
            elif isinstance(device, str):
                for index in range(pynvml.nvmlDeviceGetCount()):
                    candidate = pynvml.nvmlDeviceGetHandleByIndex(index)
                    uuid = pynvml.nvmlDeviceGetUUID(candidate)
                    if (uuid.decode() if isinstance(uuid, bytes) else uuid).startswith(device):
                        handle = candidate
                        break
        except Exception as error:  # NVMLError_InvalidArgument: no such index
            handle, reason = None, f" ({error})"
        else:
            reason = ""
        reader = cls(pynvml, handle)
        if handle is None:
            log.debug("GPU statistics off: NVML has no device for CUDA device %d%s", gpu_index, reason)
            reader.close()
            return None
        return reader

    def _reading(self, read: Any) -> Any:
        try:
            return read()
        except self.nvml.NVMLError:  # NVMLError_NotSupported among others
            return None

    def read(self) -> dict[str, float | None]:
        nvml, handle = self.nvml, self.handle
        utilization = self._reading(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        memory = self._reading(lambda: nvml.nvmlDeviceGetMemoryInfo(handle))
        milliwatts = self._reading(lambda: nvml.nvmlDeviceGetPowerUsage(handle))
        return {
            # Percent of the last sample period (1/6 s to 1 s, by product) in which a kernel ran.
            "gpu_util_percent": None if utilization is None else float(utilization),
            # The whole device, every process on it: with one rank per GPU, this rank's.
            "gpu_mem_used_gib": None if memory is None else memory.used / GIB,
            "gpu_mem_total_gib": None if memory is None else memory.total / GIB,
            "gpu_power_w": None if milliwatts is None else milliwatts / 1000.0,
        }

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:
            pass


# ---------------------------------------------------------------------------------------------
# The sampler


class StatsSampler:
    """Samples this rank's statistics every ``interval`` seconds in a daemon thread;
    ``take_epoch()`` returns the means since the previous call.

    Keys (flat, for metrics.jsonl): ``cpu_percent``, ``rss_gib``, ``workers_count``,
    ``workers_cpu_percent``, ``workers_rss_gib``, ``workers_cpu_share`` (0..1), ``stats_samples``;
    with a GPU also ``gpu_util_percent``, ``gpu_mem_used_gib``, ``gpu_mem_total_gib`` and
    ``gpu_power_w`` (left out where the board does not report power).
    """

    def __init__(self, interval: float = 1.0, gpu_index: int | None = None,
                 process: psutil.Process | None = None, scan_interval: float = 10.0):
        if interval <= 0:
            raise ValueError(f"StatsSampler interval must be positive seconds, got {interval}")
        self.interval = interval
        self.gpu_index = gpu_index
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures = 0
        # The first CPU window starts now, so a take_epoch() with no thread still has a mean.
        self._processes = _ProcessReader(process if process is not None else psutil.Process(), scan_interval)
        self._gpu = _NvmlReader.open(gpu_index) if gpu_index is not None else None
        self._means = SampleMeans()

    @property
    def has_gpu(self) -> bool:
        return self._gpu is not None

    def _sample(self, scan: bool = False) -> dict[str, float | None]:
        """One reading of every statistic, now (CPU figures cover the time since the last);
        ``scan``: look for new workers now."""
        sample = self._processes.read(scan)
        if self._gpu is not None:
            sample.update(self._gpu.read())
        return sample

    def _record(self, scan: bool = False) -> None:
        """Adds a sample to the epoch's means. Called with the lock held: the clocks are shared.
        Statistics must never stop training: a failure is noted (the first one as a warning)."""
        try:
            self._means.add(self._sample(scan))
        except Exception:
            self._failures += 1
            level = logging.WARNING if self._failures == 1 else logging.DEBUG
            log.log(level, "statistics sample failed", exc_info=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with self._lock:
                self._record()

    def start(self) -> StatsSampler:
        if self._thread is not None:
            raise RuntimeError("StatsSampler already started")
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="hvdtrain-stats", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread (within one sample's time, not one interval) and closes NVML; a later
        take_epoch() still answers, without GPU fields."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._gpu is not None:
                self._gpu.close()
                self._gpu = None

    def take_epoch(self) -> dict[str, float]:
        """Means of the samples since the last call and of one taken now (so an epoch shorter
        than the interval has one too), then starts over."""
        with self._lock:
            # The epoch's last window ends now, with a look for workers started during the epoch,
            # whose CPU time would otherwise be counted in the next one.
            self._record(scan=True)
            means, self._means = self._means, SampleMeans()
        return _summary(means)

    def __enter__(self) -> StatsSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def across_ranks(ranks: list[Mapping[str, float]]) -> dict[str, float]:
    """Every rank's ``take_epoch()`` -> the epoch's figures: the mean over ranks of each key (as
    ``take_epoch`` names them), and ``gpu_util_percent_min``, the least busy GPU (the 95% rule
    is about every GPU)."""
    out: dict[str, float] = {}
    for key in KEYS:
        values = [float(r[key]) for r in ranks if r.get(key) is not None]
        if values and key != "stats_samples":
            out[key] = sum(values) / len(values)
    utilization = [float(r["gpu_util_percent"]) for r in ranks if r.get("gpu_util_percent") is not None]
    if utilization:
        out["gpu_util_percent_min"] = min(utilization)
    return out
