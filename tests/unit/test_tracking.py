"""The tracker's side of the training thread, without a network: a missing package is one line, a
tracker that hangs never holds a training step, and metrics.jsonl records map to tracker series.
(Real MLflow and W&B runs: tests/parallel/test_tracking.py.)"""

from __future__ import annotations

import importlib.util
import json
import threading
import time

import pytest
import torch

from hvdtrain.config import ConfigError
from hvdtrain.job_config import load_config
from hvdtrain.observe import tracking, tracking_sender
from hvdtrain.observe.metrics import MetricSums


def test_a_tracker_that_is_not_installed_stops_with_how_to_install_it(monkeypatch):
    cfg = load_config("debug", ["tracking.mlflow.enabled=true"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    with pytest.raises(ConfigError) as error:
        tracking.require_packages(cfg)
    assert str(error.value) == ("tracking.mlflow.enabled=true needs the mlflow package: pip install -e .[mlflow] "
                                "(or make setup EXTRAS=mlflow)")
    tracking.require_packages(load_config("debug"))  # nothing enabled: nothing needed


def test_log_checkpoints_needs_a_tracker():
    with pytest.raises(ConfigError, match="tracking.log_checkpoints=best' needs a tracker"):
        load_config("debug", ["tracking.log_checkpoints=best"])


def test_epoch_records_become_tensorboard_named_series():
    record = {"split": "train", "epoch": 2, "step": 12, "loss": 0.5, "samples": 96, "by_rank": [{"host": "a"}],
              "stragglers": [], "flag": True}
    assert tracking.epoch_values(record) == {"train/loss": 0.5, "train/samples": 96, "epoch": 2}
    assert tracking.epoch_values({**record, "split": "val"}) == {"val/loss": 0.5, "val/samples": 96}
    assert tracking.flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": 2}) == {"a.b": 1, "a.c.d": "x", "e": 2}


class Hanging(tracking_sender.Backend):
    """A tracker whose every send hangs (a server that stopped answering mid-run)."""

    name = "hanging"
    release = threading.Event()

    def __init__(self, cfg, run_dir):
        self.sent = []

    def start(self, ids, params, env):
        return {"id": "h1"}, "hanging run h1"

    def log(self, batch):
        self.sent.extend(batch)
        self.release.wait(30)

    def finish(self, status):
        pass


def test_a_hanging_tracker_never_holds_the_training_thread(monkeypatch, tmp_path):
    monkeypatch.setitem(tracking_sender.BACKENDS, "hanging", Hanging)
    monkeypatch.setattr(tracking, "QUEUE_SIZE", 50)
    cfg = load_config("debug", ["tracking.every_steps=1", "tracking.flush_seconds=1"])
    lines: list[str] = []
    state = tracking.TrackingState()
    tracker = tracking.Tracker(cfg, tmp_path, state, ["host"], lines.append, names=["hanging"], in_process=True)
    assert state.state_dict() == {"hanging": {"id": "h1"}}  # a checkpoint waits for the run's id
    sums = MetricSums(4)
    tracker.start_epoch(0, sums)
    began = time.perf_counter()
    for step in range(1, 2001):
        sums.add(torch.tensor([1.0, 1.0, 1.0, 2.0], dtype=torch.float64))
        tracker.after_step(step, sums, lambda s: {"loss": float(s[0] / s[3]), "samples": int(s[3])}, 0.1, 16)
    # A send hangs for 30 s; the 2,000 steps never wait for it (generous bounds: a loaded machine).
    assert time.perf_counter() - began < 20
    assert tracker.hook_seconds / tracker.hook_calls < 5e-3
    # Queued, in the pipe to the sender (64 KiB) or in the hanging batch; the rest dropped and counted.
    assert tracker.hook_calls == 2000 and tracker.dropped > 0
    began = time.perf_counter()
    tracker.close("finished")
    assert time.perf_counter() - began < 5
    assert any("values dropped (queue full)" in line and "not sent within 1 s (tracking.flush_seconds)" in line
               for line in lines), lines
    Hanging.release.set()
    sent = [values for _, _, values in tracker.sender.backends[0].sent]
    assert sent[0] == {"train_step/loss": 0.5, "train_step/lr": 0.1, "train_step/samples_per_sec": sent[0][
        "train_step/samples_per_sec"]} and sent[0]["train_step/samples_per_sec"] > 0


SENDER_SCRIPT = """
import os, sys, torch
from pathlib import Path
from hvdtrain.observe import tracking, tracking_sender
from hvdtrain.job_config import load_config
from hvdtrain.observe.metrics import MetricSums
run_dir = Path(sys.argv[1])
cfg = load_config("debug", ["tracking.every_steps=2", "tracking.mlflow.enabled=true",
                            f"tracking.mlflow.tracking_uri=sqlite:///{run_dir}/mlflow.db"])
state = tracking.TrackingState()
tracker = tracking.Tracker(cfg, run_dir, state, ["host"], print)
state.starting.wait(240)  # a new Python importing mlflow: seconds, more on a loaded machine
print("ids", state.ids["mlflow"]["run_id"])
sums = MetricSums(4)
tracker.start_epoch(0, sums)
for step in range(1, 7):
    sums.add(torch.tensor([float(step), 1.0, 1.0, 2.0], dtype=torch.float64))
    tracker.after_step(step, sums, lambda s: {"loss": float(s[0] / s[3])}, 0.1, 16)
tracker.epoch({"split": "val", "epoch": 0, "step": 6, "loss": 0.25})
tracker.close("finished")
print("sender", tracker.process.pid, tracker.process.returncode, os.getpid())
print("imported", sorted(name for name in ("mlflow", "wandb") if name in sys.modules))
"""


def test_the_trackers_run_in_a_sender_process_and_the_training_process_never_imports_them(tmp_path):
    pytest.importorskip("mlflow")
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SENDER_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    run_id = next(line.split()[1] for line in lines if line.startswith("ids "))
    sender = next(line.split() for line in lines if line.startswith("sender "))
    assert sender[1] != sender[3] and sender[2] == "0"  # another process, which ended cleanly
    assert lines[-1] == "imported []"  # neither tracker's library in the training process
    closing = next(line for line in lines if "training-thread cost" in line)
    assert "sender process" in closing and "(4 values)" in closing and "failed" not in closing, closing
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    assert client.get_run(run_id).info.status == "FINISHED"
    history = client.get_metric_history(run_id, "train_step/loss")
    # Points at steps 2, 4, 6: rank 0's mean loss over the two steps since the last point.
    assert [(m.step, m.value) for m in history] == [(2, 0.75), (4, 1.75), (6, 2.75)]
    assert [m.value for m in client.get_metric_history(run_id, "val/loss")] == [0.25]


class Recording(tracking_sender.Backend):
    """A tracker that keeps what it was given at start (the run's parameters)."""

    name = "recording"
    started: list[dict] = []

    def __init__(self, cfg, run_dir):
        pass

    def start(self, ids, params, env):
        Recording.started.append(params)
        return {"id": "r1"}, "recording run r1"

    def log(self, batch):
        pass

    def finish(self, status):
        pass


def test_a_resume_through_changed_settings_is_a_parameter_of_its_own(monkeypatch, tmp_path):
    # checkpoint.resume=force over optim.base_lr, and a changed epoch count: both on the record,
    # under the step the run resumed at, beside the run's new values (any password masked).
    monkeypatch.setitem(tracking_sender.BACKENDS, "recording", Recording)
    cfg = load_config("debug", ["optim.base_lr=0.2", "train.epochs=3"])
    changes = {"step": 12, "forced": ["optim.base_lr"],
               "changed": {"optim.base_lr": [0.1, 0.2], "train.epochs": [2, 3],
                           "data.s3_endpoint": ["https://u:secret@old", "https://u:secret@new"]}}
    for resume in (changes, None):
        tracker = tracking.Tracker(cfg, tmp_path, tracking.TrackingState(), ["host"], lambda line: None,
                                   names=["recording"], in_process=True, resume=resume)
        tracker.close("finished")
    forced, plain = Recording.started[-2:]
    record = json.loads(forced.pop("resumed_at_step_12"))
    assert record["forced"] == ["optim.base_lr"] and record["changed"]["train.epochs"] == [2, 3]
    assert "secret" not in json.dumps(record)
    assert forced == plain and forced["optim.base_lr"] == 0.2
