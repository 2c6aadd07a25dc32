"""What a user sees of a running job, from real 2-rank jobs: step phases and host statistics per
rank in metrics.jsonl, a straggler named when one rank is really slowed down, Horovod's timeline
for a step range, and Horovod's stall inspector as hvdtrain configures it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch

from tests.helpers import BIN, REPO, job_env, launch, read_metrics, tiny, training_processes

PHASES = ("data", "compute", "allreduce", "optimizer", "other")


def test_step_phases_and_host_statistics_per_rank(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    launch("horovodrun-gloo", 2, ["-m", "hvdtrain"] + tiny(tiny_data, run_dir, "data.workers=1",
                                                           "runtime.stats_interval=0.2"), tmp_path)
    train = [r for r in read_metrics(run_dir) if r["split"] == "train"]
    assert len(train) == 2
    for record in train:
        assert sum(record[f"phase_{p}"] for p in PHASES) == pytest.approx(1.0)
        assert record["phase_compute"] > 0 and record["busy_ms_per_step"] > 0
    # Epoch 1's 4 steps include the loader worker's start (its first batch): on a loaded machine
    # waiting for data was 76% of them (compute 7.5%). Epoch 2 is the steady state.
    assert train[1]["phase_compute"] > 0.1
    for record in train:
        assert [r["rank"] for r in record["by_rank"]] == [0, 1]
        for row in record["by_rank"]:
            assert row["host"] == "localhost"
            assert sum(row[p] for p in PHASES) == pytest.approx(1.0, abs=1e-3)
            assert row["cpu_percent"] > 5 and row["rss_gib"] > 0.05
            assert row["workers_count"] > 0  # its loader worker (and the forkserver), seen
        assert not any(key.startswith("gpu_") for key in record)  # no GPU, no NVML: no GPU fields
    # A worker first seen in an epoch's last sample has its CPU time counted from the next sample
    # on, so on a loaded machine one epoch may show none of it; the run as a whole does.
    assert any(0 < record["workers_cpu_share"] < 1 for record in train)
    assert any(row["workers_cpu_percent"] > 0 for record in train for row in record["by_rank"])


@pytest.mark.slow
def test_a_slowed_rank_is_named_as_the_straggler(tiny_data, tmp_path):
    """Rank 1 is stopped for 0.3 s of every 0.4 s (SIGSTOP/SIGCONT) while both ranks train: its
    busy time per step rises well above rank 0's, and rank 0 only waits for it in the allreduce."""
    run_dir = tmp_path / "run"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", str(BIN / "python"), "-m",
           "hvdtrain"] + tiny(tiny_data, run_dir, "train.steps_per_epoch=6", "dist.timeout_seconds=120")
    job = subprocess.Popen(cmd, cwd=tmp_path, env=job_env(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    done = threading.Event()

    def slow_down_rank_1() -> None:
        pid = None
        while pid is None and not done.is_set():
            pid = next((p for p, env in training_processes(str(run_dir)).items()
                        if env.get("HOROVOD_RANK") == "1"), None)
            time.sleep(0.05)
        while not done.is_set():
            try:
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.3)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.1)
            except ProcessLookupError:
                return

    slower = threading.Thread(target=slow_down_rank_1, daemon=True)
    slower.start()
    try:
        output, _ = job.communicate(timeout=600)
    finally:
        done.set()
        slower.join()
    assert job.returncode == 0, output[-4000:]
    train = [r for r in read_metrics(run_dir) if r["split"] == "train"]
    named = [s for r in train for s in r.get("stragglers", [])]
    assert {(s["rank"], s["host"]) for s in named} == {(1, "localhost")}, train
    assert all(s["slower"] > 0.15 and s["phase"] in ("data", "compute", "optimizer") for s in named)
    assert "hvdtrain: straggler: rank 1 on localhost is " in output
    for record in train:  # the fast rank waits for the slow one in the allreduce
        rows = {row["rank"]: row for row in record["by_rank"]}
        assert rows[0]["allreduce"] > rows[1]["allreduce"]


def test_timeline_of_a_step_range_is_chrome_trace_json(tiny_data, tmp_path):
    run_dir, timeline = tmp_path / "run", tmp_path / "trace" / "timeline.json"
    result = launch("horovodrun-gloo", 2, ["-m", "hvdtrain"] + tiny(
        tiny_data, run_dir, f"runtime.timeline={timeline}", "runtime.timeline_steps=2-5"), tmp_path)
    assert f"recording Horovod's timeline to {timeline} from global step 2 to 5" in result.stdout
    assert f"timeline written to {timeline}" in result.stdout
    events = json.loads(timeline.read_text())  # the whole file parses: valid JSON, closed
    assert isinstance(events, list) and all("ph" in event for event in events)
    tensors = {e["pid"]: e["args"]["name"] for e in events
               if e.get("name") == "process_name" and "name" in e.get("args", {})}
    allreduces: dict[str, int] = {}
    for event in events:
        if event.get("ph") == "B" and event.get("name") == "ALLREDUCE":
            allreduces[tensors[event["pid"]]] = allreduces.get(tensors[event["pid"]], 0) + 1
    parameters = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=False)["model"]
    gradients = {name for name in parameters if name.endswith(("weight", "bias")) and "running" not in name}
    # On CPU the gradients go in 25 MB groups (dist.bucket_mb): each is one tensor of a grouped
    # allreduce, named after the group's first parameter ("grouped_allreduce.fc.bias_3of14").
    # (BatchNorm's running statistics are averaged in one group of their own at the end of an epoch.)
    grouped = {name for name in allreduces
               if name.startswith("grouped_allreduce.") and not name.startswith("grouped_allreduce.average_buffers")}
    # Global steps 2, 3 and 4: every gradient allreduced exactly three times, nothing outside.
    assert gradients and len(grouped) == len(gradients), allreduces
    assert all(allreduces[name] == 3 for name in grouped), allreduces
    assert not gradients & {name.removeprefix("allreduce.") for name in allreduces}  # none on its own
    assert any(event.get("name") == "CYCLE_START" for event in events)  # cycle marks are on


@pytest.mark.timing  # shut down before the 60 s rank 1 sleeps: 5 s here
def test_stall_inspector_warns_then_shuts_the_job_down(tmp_path):
    """Rank 1 is 60 s late to an allreduce: Horovod's stall inspector, set by hvdtrain to warn
    after 2 s and stop after 5 s, names the tensor and the missing rank and ends the job.

    Under the MPI controller: in Horovod 0.28.1 the inspector never reports under Gloo (a rank
    75 s late at the default 60 s gave no warning; docs/fault-tolerance.md)."""
    started = time.monotonic()
    result = launch("horovodrun-mpi", 2, [str(REPO / "tests" / "parallel" / "stall_probe.py"), "2", "5", "60"],
                    tmp_path, timeout=300, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert time.monotonic() - started < 50, output[-3000:]  # not the 60 s rank 1 sleeps
    assert "late_tensor" in output and "missing ranks" in output.lower(), output[-3000:]
    assert "done" not in result.stdout


@pytest.mark.timing  # shut down before the 60 s rank 1 sleeps: 5 s here
def test_the_users_exported_stall_inspector_settings_win_over_the_configs(tmp_path):
    """horovodrun --stall-check-warning-time-seconds 2 --stall-check-shutdown-time-seconds 5 exports
    these variables; the config's 60 s warning and no shutdown (hvdtrain's defaults) used to replace
    them, and the job then waited out rank 1's 60 s. The exported ones now apply, and a start-up
    line says so."""
    started = time.monotonic()
    result = launch("horovodrun-mpi", 2, [str(REPO / "tests" / "parallel" / "stall_probe.py"), "60", "0", "60"],
                    tmp_path, timeout=300, check=False,
                    env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "2", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"})
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "done" not in result.stdout, output[-3000:]
    assert time.monotonic() - started < 50, output[-3000:]
    assert "late_tensor" in output and "missing ranks" in output.lower(), output[-3000:]
    assert ("hvdtrain: Horovod's stall inspector as exported (HOROVOD_STALL_CHECK_TIME_SECONDS=2, "
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=5), not as dist.stall_warning_seconds=60, "
            "dist.stall_shutdown_seconds=0 would set it") in output, output[-3000:]


@pytest.mark.timing  # a spinning wait costs about 1.0 x the wall time; a sleeping one under 0.01
@pytest.mark.parametrize("kind", ["horovodrun-gloo", "mpirun"])
def test_waiting_for_a_late_rank_costs_the_training_thread_no_cpu(kind, tmp_path):
    """Horovod 0.28.1's synchronize() spun on sched_yield while it waited (a core burned per rank,
    taken from the threads doing the allreduce); third_party/horovod/0002 makes it sleep
    on a condition variable."""
    result = launch(kind, 2, [str(REPO / "tests" / "parallel" / "wait_probe.py"), "3"], tmp_path, timeout=180)
    found = re.search(r"rank 0 waited ([\d.]+) s wall, ([\d.]+) s thread CPU, sum 2", result.stdout)
    assert found, result.stdout[-2000:]
    wall, cpu = float(found[1]), float(found[2])
    assert wall > 2.0, f"rank 0 did not wait for rank 1 ({wall:.3f} s): {result.stdout[-2000:]}"
    assert cpu < 0.1 * wall, f"rank 0's training thread used {cpu:.3f} s of CPU in a {wall:.3f} s wait"


@pytest.mark.timing  # the two settings differ by the cycle: about 0.5 s against a few ms
@pytest.mark.parametrize("wake", ["default", "0"])
def test_a_tensor_starts_its_cycle_when_it_arrives_under_gloo(wake, tmp_path):
    """With a 1 s cycle, a tensor that every rank submits at once waits for the next cycle: about
    0.5 s. The patch's HOROVOD_CYCLE_WAKE_ON_ENQUEUE, which hvdtrain turns on under Gloo on CPU,
    starts the cycle when the tensor arrives. "0" turns it off: the same probe must then be slow."""
    argv = [str(REPO / "tests" / "parallel" / "cycle_probe.py"), "1000"] + ([] if wake == "default" else [wake])
    result = launch("horovodrun-gloo", 2, argv, tmp_path, timeout=180)
    found = re.findall(r"rank (\d): median allreduce ([\d.]+) s \(wake (\w+)\)", result.stdout)
    assert sorted(rank for rank, _, _ in found) == ["0", "1"], result.stdout[-2000:]
    for rank, seconds, setting in found:
        if wake == "default":
            assert setting == "1" and float(seconds) < 0.15, f"rank {rank}: {seconds} s with the wake on"
        else:
            assert setting == "0" and float(seconds) > 0.2, f"rank {rank}: {seconds} s with the wake off"
