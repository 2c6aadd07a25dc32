"""Experiment tracking for real: a real ``mlflow server`` on loopback and W&B's offline mode, with
really launched 2-rank jobs (horovodrun and mpirun), read back through MLflow's client and wandb's
own reader of its transaction log (``wandb leet inspect --json``), and compared with metrics.jsonl.

One horovodrun job checks both trackers at once, through a SIGTERM and a resume: one MLflow run,
one W&B run id, no step missing or sent twice. The mpirun job checks MLflow alone; a job pointed at
a closed port finishes with one warning line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import BIN, job_env, launch, rank_pids, wait_for_line

pytest.importorskip("mlflow", reason="the mlflow extra is not installed: pip install -e .[test]")
pytest.importorskip("wandb", reason="the wandb extra is not installed: pip install -e .[test]")

PORT, CLOSED_PORT = 28150, 28199  # this file's loopback ports (28100-28199)
STEPS = 20                        # debug config with 5 epochs: 4 steps per epoch (time for the
                                  # trackers to start before the SIGTERM, on a loaded machine too)


def free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    """A real MLflow tracking server (SQLite store, local artifact root), ended however the tests end."""
    root = tmp_path_factory.mktemp("mlflow")
    assert free(PORT), f"port {PORT} is taken"
    log = (root / "server.log").open("w")
    server = subprocess.Popen(
        [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root / 'store.db'}",
         "--default-artifact-root", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(PORT),
         "--workers", "1"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        # No job runner (its huey workers are a dozen processes the tests never use).
        env={**job_env(root), "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    try:
        uri = f"http://127.0.0.1:{PORT}"
        deadline = time.monotonic() + 300  # slow on a loaded 2-core machine: it migrates a fresh database
        while True:
            assert server.poll() is None, (root / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "mlflow server did not answer in 300 s"
            time.sleep(1)
        yield uri
    finally:
        # The server's session: the mlflow CLI and its uvicorn child. SIGTERM, then SIGKILL for
        # whatever is left of the group (the CLI may exit before its children).
        for signum in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(server.pid, signum)
            except ProcessLookupError:
                break
            try:
                server.wait(15)
            except subprocess.TimeoutExpired:
                pass
        log.close()


def train_args(tiny_data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["-m", "hvdtrain", "--config", "debug", f"data.dir={tiny_data}", f"output.dir={run_dir}",
            "train.epochs=5", *extra]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def resolved_config(run_dir: Path) -> dict[str, str]:
    from hvdtrain.observe.tracking import flatten

    return {key: str(value) for key, value in flatten(yaml.safe_load((run_dir / "config.yaml").read_text())).items()}


def epoch_series(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl as tracker series: ``val/top1`` -> [(step, value), ...]."""
    from hvdtrain.observe.tracking import epoch_values

    series: dict[str, list[tuple[int, float]]] = {}
    for record in records(run_dir):
        for key, value in epoch_values(record).items():
            series.setdefault(key, []).append((record["step"], value))
    return series


def check_mlflow(uri: str, experiment: str, run_dir: Path, every: int, steps: int = STEPS) -> object:
    """Exactly one run; params == the resolved config; epoch series == metrics.jsonl; step-level
    points at every ``every`` steps, each once."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params == resolved_config(run_dir)
    assert run.data.tags["hvdtrain.world_size"] == "2"
    expected = epoch_series(run_dir)
    assert "val/top1" in expected and "train/phase_compute" in expected
    for key, series in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(step, float(value)) for step, value in series], key
    sent = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_step/loss"))
    assert sent == list(range(every, steps + 1, every))
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["tracking"]["mlflow"] == {"run_id": run.info.run_id, "tracking_uri": uri}
    return run


def wandb_records(run_dir: Path) -> dict[str, list[dict]]:
    """Every offline run under run_dir/wandb, read with wandb's own reader: run id -> records."""
    found: dict[str, list[dict]] = {}
    for folder in sorted((run_dir / "wandb").glob("offline-run-*")):
        (log,) = folder.glob("run-*.wandb")
        shown = subprocess.run([str(BIN / "wandb"), "leet", "inspect", "--json", str(log)], capture_output=True,
                               text=True, timeout=120, check=True)
        run_id = log.stem.removeprefix("run-")
        found.setdefault(run_id, []).append([json.loads(line) for line in shown.stdout.splitlines() if line.strip()])
    return found


def test_one_tracked_run_across_sigterm_and_resume_horovodrun(mlflow_uri, tiny_data, tmp_path, monkeypatch):
    """Both trackers at once, step-level values every step and the best checkpoint as an artifact."""
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # W&B's artifact staging
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    run_dir = tmp_path / "run"
    program = [str(BIN / "python")] + train_args(
        tiny_data, run_dir, "tracking.wandb.enabled=true", "tracking.wandb.mode=offline",
        "tracking.wandb.project=hvdtrain-test", "tracking.mlflow.enabled=true",
        f"tracking.mlflow.tracking_uri={mlflow_uri}", "tracking.mlflow.experiment=horovodrun",
        "tracking.every_steps=1", "tracking.log_checkpoints=best", "checkpoint.keep=0",
        "tracking.flush_seconds=300")  # W&B's finish can take minutes on a loaded 2-core machine
    job = subprocess.Popen([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"] + program,
                           cwd=tmp_path, env=job_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    try:
        # Both trackers have started (their ids are in the next checkpoint) and an epoch is done.
        lines = wait_for_line(job, "epoch 1/5 ", timeout=300)
        for started in ("tracking: wandb run", "tracking: mlflow run"):
            if not any(started in line for line in lines):
                wait_for_line(job, started, timeout=300, lines=lines)

        pids = rank_pids(str(run_dir))
        assert sorted(pids) == [0, 1], pids
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    first = "".join(lines) + rest
    assert job.returncode != 0 and "stopped by SIGTERM" in first, first[-3000:]
    assert first.count("hvdtrain: tracking: mlflow run") == 1 and "warning" not in first.lower(), first[-3000:]
    stopped_at = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["step"]
    assert 4 <= stopped_at < STEPS

    second = launch("horovodrun-gloo", 2, program[1:], tmp_path).stdout
    assert "hvdtrain: tracking: mlflow run" in second and "(resumed, " in second
    assert "warning" not in second.lower(), second[-3000:]

    run = check_mlflow(mlflow_uri, "horovodrun", run_dir, every=1)
    from mlflow.tracking import MlflowClient

    artifacts = [a.path for a in MlflowClient(mlflow_uri).list_artifacts(run.info.run_id, "checkpoints")]
    assert artifacts == ["checkpoints/best.pt"]

    # W&B: one run id, written by the first job and the resumed one (two offline folders).
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["tracking"]
    offline = wandb_records(run_dir)
    assert list(offline) == [saved["wandb"]["id"]] and len(offline[saved["wandb"]["id"]]) == 2
    parts = offline[saved["wandb"]["id"]]
    config = [r["run"]["config"]["update"] for r in parts[0] if r["type"] == "run"][0]
    env = config.pop("env")
    config.pop("_wandb", None)
    from hvdtrain.observe.tracking import flatten

    assert config == flatten(yaml.safe_load((run_dir / "config.yaml").read_text()))  # JSON writes 0.0 as 0
    assert env["world_size"] == 2 and env["torch_version"] == torch.__version__
    history: dict[str, list[tuple[int, float]]] = {}
    for part in parts:
        for r in part:
            if r["type"] == "history":
                for key, value in r["history"]["item"].items():
                    if not key.startswith("_"):
                        history.setdefault(key, []).append((r["history"]["step"]["num"], value))
    for key, series in epoch_series(run_dir).items():
        assert history[key] == series, key
    assert [step for step, _ in history["train_step/loss"]] == list(range(1, STEPS + 1))
    assert [r["exit"]["exit_code"] for part in parts for r in part if r["type"] == "exit"] == [75, 0]
    assert any(r["type"] == "artifact" for part in parts for r in part)


def test_one_tracked_run_mpirun(mlflow_uri, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    launch("mpirun", 2, train_args(tiny_data, run_dir, "tracking.mlflow.enabled=true",
                                   f"tracking.mlflow.tracking_uri={mlflow_uri}", "tracking.mlflow.experiment=mpirun",
                                   "tracking.every_steps=3", "train.epochs=2"), tmp_path)
    check_mlflow(mlflow_uri, "mpirun", run_dir, every=3, steps=8)


def test_an_unreachable_tracker_costs_one_warning(tiny_data, tmp_path):
    assert free(CLOSED_PORT)
    run_dir = tmp_path / "run"
    result = launch("single", 1, train_args(tiny_data, run_dir, "train.epochs=1", "tracking.mlflow.enabled=true",
                                            f"tracking.mlflow.tracking_uri=http://127.0.0.1:{CLOSED_PORT}"), tmp_path)
    output = result.stdout + result.stderr
    warnings = [line for line in output.splitlines() if "warning" in line.lower()]
    assert len(warnings) == 1 and "tracking with mlflow is off for this run" in warnings[0], output[-3000:]
    assert [r["split"] for r in records(run_dir)] == ["train", "val"]
