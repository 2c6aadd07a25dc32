"""hostfiles/slurm/requeue.sh without Slurm: a stand-in scontrol records the requeue; the command is a
small shell script. (tests/multinode/test_slurm_requeue.py runs the batch scripts on a real Slurm.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from hvdtrain.fault.attempts import exit_of, job_identity

REQUEUE = Path(__file__).resolve().parents[2] / "hostfiles" / "slurm" / "requeue.sh"
# Exits with $CODE after $TICKS tenths of a second, or with 75 once it gets SIGUSR1 (as the ranks do
# after their checkpoint).
COMMAND = "trap 'echo got USR1 >> \"$LOG\"; exit 75' USR1; echo started >> \"$LOG\"; " \
          "for i in $(seq 1 $TICKS); do sleep 0.1; done; exit $CODE"


def start(tmp_path: Path, code: int, restarts: int | None = None, most: int | None = None,
          ticks: int = 100) -> subprocess.Popen:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "scontrol $*" >> "$LOG"\n')
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "LOG": str(tmp_path / "log"),
           "CODE": str(code), "TICKS": str(ticks)}
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    if most is not None:
        env["HVDTRAIN_MAX_REQUEUES"] = str(most)
    command = tmp_path / "command.sh"
    command.write_text(COMMAND + "\n")
    script = f'set -euo pipefail; source "{REQUEUE}"; run_and_requeue USR1 bash "{command}"'
    return subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def log(tmp_path: Path) -> list[str]:
    path = tmp_path / "log"
    return path.read_text().splitlines() if path.exists() else []


def test_a_stop_signal_reaches_the_command_and_a_75_requeues_the_job(tmp_path):
    shell = start(tmp_path, code=0)
    deadline = time.monotonic() + 10
    while "started" not in log(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    shell.send_signal(signal.SIGTERM)  # as Slurm's --signal=B:TERM@120 or scancel --batch do
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert log(tmp_path) == ["started", "got USR1", "scontrol requeue 42"]
    assert "requeued (restart 1 of at most 20)" in err


def test_other_codes_are_not_requeued_and_are_the_jobs_own(tmp_path):
    for code in (0, 1, 2, 74):
        (tmp_path / "log").unlink(missing_ok=True)
        shell = start(tmp_path, code=code, ticks=1)  # no signal comes: end at once
        shell.communicate(timeout=30)
        assert shell.returncode == code
        assert not any(line.startswith("scontrol") for line in log(tmp_path)), (code, log(tmp_path))


def test_the_requeues_are_capped(tmp_path):
    shell = start(tmp_path, code=75, restarts=3, most=3, ticks=1)
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 75
    assert not any(line.startswith("scontrol") for line in log(tmp_path))
    assert "requeued 3 times already (HVDTRAIN_MAX_REQUEUES=3): not requeued again" in err


def test_attempt_records_name_the_job_and_the_exit():
    from hvdtrain.config import ConfigError
    from hvdtrain.train.stops import Preempted

    assert exit_of(None) == (0, "finished")
    assert exit_of(Preempted("stopped by SIGTERM in epoch 2/3")) == (75, "stopped by SIGTERM in epoch 2/3")
    assert exit_of(ConfigError("config key 'x': unknown")) == (2, "config key 'x': unknown")
    assert exit_of(RuntimeError("boom\nmore")) == (1, "RuntimeError: boom")
    saved = {k: os.environ.pop(k) for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "PBS_JOBID", "LSB_JOBID", "JOB_ID")
             if k in os.environ}
    try:
        assert job_identity() == {"job": None, "restart": None}
        os.environ.update(SLURM_JOB_ID="7", SLURM_RESTART_COUNT="2")
        assert job_identity() == {"job": "7", "restart": 2}
    finally:
        for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
            os.environ.pop(key, None)
        os.environ.update(saved)


def test_a_stop_signal_during_start_up_is_kept_for_the_first_step():
    """Slurm's signal ahead of the time limit may come while the ranks still build their loaders: it
    must not end them (SIGUSR1's default action does), but stop the run at its first step."""
    from hvdtrain.fault.preemption import StopRequest

    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest()
    stop.keep_early()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert stop.received == signal.SIGUSR1 and stop.reason() == "SIGUSR1"
    finally:
        stop.release_early()
    assert signal.getsignal(signal.SIGUSR1) is before
