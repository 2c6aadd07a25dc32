"""A password in ``tracking.mlflow.tracking_uri`` is masked wherever hvdtrain writes or prints it,
and the real one still reaches MLflow.

``http://alice:s3cret@host:5000`` used to be copied into ``--print-config``, config.yaml, every
checkpoint, the MLflow params (and W&B config) and the tracker's start-up line. The MLflow test
runs against a small fake tracking server that records each request's Authorization header and
body: the password travels only as HTTP basic auth, and a masked copy of the URI (``***``, as
config.yaml holds it) is never sent as a password.
"""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from hvdtrain import cli
from hvdtrain.checkpoint.io import CheckpointSaver
from hvdtrain.config import dump_yaml, to_dict
from hvdtrain.job_config import load_config
from hvdtrain.observe import tracking
from hvdtrain.redact import mask_text, mask_values

PASSWORD = "s3cret-Pa55"


@pytest.mark.parametrize("text, masked", [
    ("http://alice:s3cret@host:5000", "http://alice:***@host:5000"),
    ("https://alice:p%40ss@host/prefix", "https://alice:***@host/prefix"),
    ("see http://a:b@h:1 and s3://key:secret@bucket/x", "see http://a:***@h:1 and s3://key:***@bucket/x"),
    ("http://host:5000", "http://host:5000"),
    ("http://alice@host:5000", "http://alice@host:5000"),
    ("sqlite:///runs/mlflow.db", "sqlite:///runs/mlflow.db"),
    ("databricks", "databricks"),
])
def test_mask_text(text, masked):
    assert mask_text(text) == masked


def test_credentials_come_out_of_the_uri_decoded():
    from hvdtrain.redact import has_password, split_credentials

    assert split_credentials("https://ana:p%40ss@host:5000/x") == ("https://host:5000/x", "ana", "p@ss")
    assert split_credentials("http://host:5000") == ("http://host:5000", None, None)
    assert has_password("http://a:b@h") and not has_password("http://a:***@h") and not has_password("")


def test_print_config_and_config_yaml_show_no_password(capsys):
    uri = f"http://alice:{PASSWORD}@mlflow.example:5000"
    assert cli.main(["--config", "debug", f"tracking.mlflow.tracking_uri={uri}", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert PASSWORD not in out and "tracking_uri: http://alice:***@mlflow.example:5000" in out
    cfg = load_config("debug", [f"tracking.mlflow.tracking_uri={uri}"])
    assert PASSWORD not in dump_yaml(cfg)  # config.yaml is written from dump_yaml
    assert cfg.tracking.mlflow.tracking_uri == uri  # the config in memory keeps the real one


def test_checkpoints_store_no_password(tmp_path):
    cfg = load_config("debug", [f"tracking.mlflow.tracking_uri=http://alice:{PASSWORD}@h:5000"])
    state = tracking.TrackingState()
    state.ids = {"mlflow": {"run_id": "r1", "tracking_uri": f"http://alice:{PASSWORD}@h:5000"}}  # an old checkpoint's
    payload = {"model": {}, "optimizer": {}, "epoch": 0, "step": 7, "config": to_dict(cfg),
               "tracking": state.state_dict()}
    path = CheckpointSaver(tmp_path, keep=1).save(payload, is_best=False)
    assert PASSWORD.encode() not in path.read_bytes()
    saved = torch.load(path, weights_only=True)
    assert saved["config"]["tracking"]["mlflow"]["tracking_uri"] == "http://alice:***@h:5000"
    assert saved["tracking"]["mlflow"]["tracking_uri"] == "http://alice:***@h:5000"
    assert payload["config"]["tracking"]["mlflow"]["tracking_uri"].endswith(f"{PASSWORD}@h:5000")  # not changed
    assert mask_values({"a": [f"http://u:{PASSWORD}@h"], "b": 3}) == {"a": ["http://u:***@h"], "b": 3}


class FakeMlflow(BaseHTTPRequestHandler):
    """The REST calls hvdtrain's MLflow backend makes, answered minimally; every request recorded."""

    requests: list[dict] = []

    def log_message(self, *args) -> None:
        pass

    def answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def handle_any(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode(errors="replace") if length else ""
        FakeMlflow.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        info = {"run_id": "run1", "run_uuid": "run1", "experiment_id": "1", "status": "RUNNING",
                "start_time": 0, "lifecycle_stage": "active", "artifact_uri": "/tmp/none"}
        if "experiments/get-by-name" in self.path:
            self.answer(404, {"error_code": "RESOURCE_DOES_NOT_EXIST", "message": "no such experiment"})
        elif "experiments/create" in self.path:
            self.answer(200, {"experiment_id": "1"})
        elif "runs/create" in self.path:
            self.answer(200, {"run": {"info": info, "data": {}}})
        elif "runs/update" in self.path:
            self.answer(200, {"run_info": info})
        elif "metrics/get-history" in self.path:
            self.answer(200, {"metrics": []})
        else:
            self.answer(200, {})

    do_GET = do_POST = handle_any


@pytest.fixture
def fake_mlflow():
    pytest.importorskip("mlflow")
    FakeMlflow.requests = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeMlflow)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def track(uri: str, run_dir, lines: list[str]) -> tracking.TrackingState:
    cfg = load_config("debug", ["tracking.mlflow.enabled=true", f"tracking.mlflow.tracking_uri={uri}",
                                "tracking.flush_seconds=30"])
    state = tracking.TrackingState()
    tracker = tracking.Tracker(cfg, run_dir, state, ["host"], lines.append, names=["mlflow"], in_process=True)
    assert state.starting.wait(120)
    tracker.close("finished")
    return state


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_the_password_reaches_mlflow_as_basic_auth_only(fake_mlflow, tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)  # and restored after the test (the sender thread sets them)
    lines: list[str] = []
    state = track(f"http://alice:{PASSWORD}@{fake_mlflow}", tmp_path, lines)
    requests = FakeMlflow.requests
    assert any("runs/log-batch" in r["path"] for r in requests), requests
    assert all(r["auth"] == basic("alice", PASSWORD) for r in requests), requests
    assert not any(PASSWORD in r["body"] or PASSWORD in r["path"] for r in requests)  # params: masked
    params = [json.loads(r["body"]) for r in requests if "runs/log-batch" in r["path"] and '"params"' in r["body"]]
    logged = {p["key"]: p["value"] for batch in params for p in batch.get("params", [])}
    assert logged["tracking.mlflow.tracking_uri"] == f"http://alice:***@{fake_mlflow}"
    assert not any(PASSWORD in line for line in lines), lines
    assert any(f"mlflow run run1 (http://alice:***@{fake_mlflow})" in line for line in lines), lines
    assert any("holds a password" in line and "MLFLOW_TRACKING_PASSWORD" in line for line in lines), lines
    assert state.state_dict()["mlflow"] == {"run_id": "run1", "tracking_uri": f"http://alice:***@{fake_mlflow}"}


def test_a_masked_uri_is_never_sent_as_a_password(fake_mlflow, tmp_path, monkeypatch):
    masked = f"http://alice:***@{fake_mlflow}"  # as config.yaml and checkpoints hold it
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_TOKEN", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    lines: list[str] = []
    track(masked, tmp_path / "a", lines)
    assert FakeMlflow.requests == []
    assert any("tracking with mlflow is off for this run" in line and "masked password" in line
               and "MLFLOW_TRACKING_PASSWORD" in line for line in lines), lines
    # With the password in the environment, as the docs say: sent, and only the real one.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PASSWORD)
    lines = []
    track(masked, tmp_path / "b", lines)
    assert FakeMlflow.requests and all(r["auth"] == basic("alice", PASSWORD) for r in FakeMlflow.requests)
    assert not any("holds a password" in line for line in lines)
