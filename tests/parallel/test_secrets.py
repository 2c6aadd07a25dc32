"""Secrets in the environment of a launch never show in a process's arguments.

horovodrun --gloo used to start every rank as ``/bin/sh -c env K=V ... python ...`` with the whole
environment, so any user of the host read WANDB_API_KEY, MLFLOW_TRACKING_* and AWS_* with ``ps``.
The patched runner (third_party/horovod/0006-no-environment-values-on-command-lines.patch) gives
the values to a local rank through its process environment. A rank here scans every process's
``/proc/PID/cmdline`` while the whole job runs, and checks that it still has the variables, values
intact (a multi-line value with quotes and a ``$`` too).
"""

from __future__ import annotations

import json
import secrets
import subprocess
from pathlib import Path

from tests.helpers import REPO, job_env, launch_command

SECRETS_PROBE = REPO / "tests" / "parallel" / "secrets_probe.py"
WATCHED = ["AWS_SECRET_ACCESS_KEY", "HVDTRAIN_TEST_MULTILINE", "MLFLOW_TRACKING_PASSWORD", "WANDB_API_KEY"]


def secret_env(folder: Path) -> dict[str, str]:
    """A fresh marker in the variables users set for trackers and object storage; the marker is
    also written to ``folder/marker`` (mode 0600) for the probe."""
    marker = f"hvdtrain-test-secret-{secrets.token_hex(8)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "marker").write_text(marker)
    (folder / "marker").chmod(0o600)
    return {"WANDB_API_KEY": marker, "MLFLOW_TRACKING_PASSWORD": marker, "AWS_SECRET_ACCESS_KEY": marker,
            "HVDTRAIN_TEST_MULTILINE": f"first line\n{marker} 'quoted' $HOME"}


def probe_lines(stdout: str) -> list[dict]:
    lines = [json.loads(line.split("SECRETS ", 1)[1]) for line in stdout.splitlines() if "SECRETS {" in line]
    return sorted(lines, key=lambda line: line["rank"])


def test_horovodrun_gloo_shows_no_secret_in_any_process_arguments(tmp_path):
    folder = tmp_path / "probe"
    cmd = launch_command("horovodrun-gloo", 2, [str(SECRETS_PROBE), str(folder)])
    result = subprocess.run(cmd, cwd=tmp_path, env={**job_env(tmp_path), **secret_env(folder)}, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    lines = probe_lines(result.stdout)
    assert [line["rank"] for line in lines] == [0, 1], result.stdout[-2000:]
    for line in lines:
        assert line["showing"] == [], f"rank {line['rank']}: the secret is in the arguments of {line['showing']}"
        assert line["seen"] == WATCHED and line["multiline_intact"], line
