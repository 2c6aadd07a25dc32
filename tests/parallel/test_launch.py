"""``hvdtrain launch``: horovodrun (Gloo and MPI) whose exit code is the ranks' own -- 2 for bad
input, 75 after a checkpointed stop, 1 for a crash -- with the cause as the last line, no
launcher traceback, and one traceback for a crash that every rank hits. Plain horovodrun returns 1
for all of these (the contrast is asserted once), and mpirun returns the ranks' code itself."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import BIN, PROBE, job_env, rank_pids, stopped_by_sigterm, tiny, wait_for_line


def launched(controller: str, program: list[str]) -> list[str]:
    return [str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2", controller,
            str(BIN / "python"), *program]


def run(cmd: list[str], tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=300)


def last_line(output: str) -> str:
    return [line for line in output.splitlines() if line.strip()][-1]


def test_bad_config_exits_2_before_any_rank_starts(tiny_data, tmp_path):
    """A config error is refused by the launcher itself (train/preflight.py), before horovodrun starts."""
    program = ["-m", "hvdtrain", *tiny(tiny_data, tmp_path / "run", "train.epochs=abc")]
    result = run(launched("--gloo", program), tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert last_line(result.stderr) == ("hvdtrain launch: exit 2 (bad configuration or data), before any rank "
                                        "started: error: config key 'train.epochs' expects int, got 'abc'")
    assert "Traceback" not in output and output.count("expects int, got 'abc'") == 1
    # What hvdtrain launch mends: horovodrun's 1 and its own traceback.
    plain = run([str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", str(BIN / "python"), *program],
                tmp_path)
    assert plain.returncode == 1 and "Traceback (most recent call last)" in plain.stderr
    assert "expects int, got 'abc'" not in last_line(plain.stderr)


@pytest.mark.parametrize("controller", ["--gloo", "--mpi"])
def test_bad_data_exits_2_with_the_cause_last_and_no_traceback(controller, tmp_path):
    """An error only the ranks can see (the data is where they run): rank 0's exit record."""
    missing = tmp_path / "no-such-data"
    program = ["-m", "hvdtrain", "--config", "debug", f"data.dir={missing}", f"output.dir={tmp_path / 'run'}"]
    result = run(launched(controller, program), tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    last = last_line(result.stderr)
    assert last.startswith("hvdtrain launch: exit 2 (bad configuration or data), rank 0: error: ")
    assert str(missing) in last
    assert "Traceback" not in output and "hvdtrain-exit" not in output


def test_mpirun_already_returns_the_ranks_code(tiny_data, tmp_path):
    program = ["-m", "hvdtrain", *tiny(tiny_data, tmp_path / "run", "train.epochs=abc")]
    result = run(["mpirun", "-np", "2", "--oversubscribe", "-bind-to", "none", str(BIN / "python"), *program],
                 tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "hvdtrain-exit" not in result.stdout + result.stderr  # no record without the launcher


def launched_and_stopped(program: list[str], run_dir, line: str, tmp_path) -> tuple[int, str]:
    """``hvdtrain launch`` of ``program`` on 2 ranks, SIGTERM to both ranks once ``line`` shows:
    (the launcher's exit code, its whole output)."""
    return stopped_by_sigterm(launched("--gloo", program), run_dir, line, tmp_path)


@pytest.mark.slow
def test_a_checkpointed_stop_exits_75_and_the_rerun_finishes(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # 6 epochs: room for the stop agreement (about every 0.5 s of steps) before the run ends.
    program = [str(PROBE), str(tmp_path / "probe"), *tiny(tiny_data, run_dir, "train.epochs=6")]
    code, output = launched_and_stopped(program, run_dir, "epoch 1/6 ", tmp_path)
    # probe.py is not the CLI: it leaves with the Preempted code, without a record; the launcher
    # takes the code horovodrun names all the same.
    assert code == 75, output
    assert "Traceback" not in output
    assert last_line(output).startswith("hvdtrain launch: exit 75 (stopped after a checkpoint: run the same "
                                        "command to resume), rank ")
    # The CLI itself: stopped in its first epochs, then the rerun finishes with 0. The first leg asks
    # for more epochs than it can reach before the stop lands, whatever the machine's speed; the rerun
    # ends with the epoch the stop fell in (train.epochs may change between legs).
    cli_dir = tmp_path / "cli"
    program = ["-m", "hvdtrain", *tiny(tiny_data, cli_dir, "train.epochs=1000")]
    code, output = launched_and_stopped(program, cli_dir, "epoch 1/1000 ", tmp_path)
    assert code == 75, output
    assert "Traceback" not in output and "hvdtrain-exit" not in output
    last = last_line(output)
    assert last.startswith("hvdtrain launch: exit 75 (stopped after a checkpoint: run the same command to resume), "
                           "rank ") and "stopped by SIGTERM in epoch" in last and "checkpoint saved to" in last
    stopped_in = int(re.search(r"stopped by SIGTERM in epoch (\d+)", last)[1])
    again = run(launched("--gloo", [*program[:-1], f"train.epochs={stopped_in}"]), tmp_path)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "resumed from" in again.stdout and "hvdtrain launch" not in again.stdout + again.stderr


CRASHING_TASK = """
from hvdtrain.tasks.image_classification import ImageClassification


class Crashing(ImageClassification):
    def build_model(self):
        raise RuntimeError("a bug in the user's build_model")
"""


def test_a_crash_every_rank_hits_shows_one_traceback_and_exits_1(tiny_data, tmp_path):
    (tmp_path / "crashing.py").write_text(CRASHING_TASK)
    program = ["-m", "hvdtrain", *tiny(tiny_data, tmp_path / "run", "task=crashing.py:Crashing")]
    result = run(launched("--gloo", program), tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert output.count("Traceback (most recent call last)") == 1, output  # rank 0's; rank 1 was ended first
    assert "RuntimeError: a bug in the user's build_model" in output
    assert last_line(result.stderr) == ("hvdtrain launch: exit 1 (a crash), rank 0: RuntimeError: a bug in the "
                                        "user's build_model")


def test_a_rank_killed_from_outside_is_named_with_its_signal(tmp_path):
    # A program that is not hvdtrain's: rank 1 dies of SIGKILL (as the OOM killer would end it).
    program = ["-c", "import os, signal, time\n"
               "if os.environ['HOROVOD_RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
               "time.sleep(30)"]
    start = time.monotonic()
    result = run(launched("--gloo", program), tmp_path)
    assert time.monotonic() - start < 25
    assert result.returncode == 137, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    assert last_line(result.stderr).startswith("hvdtrain launch: exit 137: rank 1 was killed by SIGKILL")


def test_usage_and_help(tmp_path):
    result = run([str(BIN / "python"), "-m", "hvdtrain", "launch"], tmp_path)
    assert result.returncode == 2 and "usage: python -m hvdtrain launch" in result.stdout
    result = run([str(BIN / "python"), "-m", "hvdtrain", "help", "launch"], tmp_path)
    assert result.returncode == 0 and "returns the ranks' exit code" in result.stdout


def discovery_script(tmp_path, host: str):
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\necho {host}:2\n")
    script.chmod(0o755)
    return script


def test_one_host_elastic_starts_at_once_on_this_host(tiny_data, tmp_path):
    # Plain horovodrun waits for a second host here until the elastic timeout (600 s by default).
    script = discovery_script(tmp_path, "localhost")
    program = ["-m", "hvdtrain", *tiny(tiny_data, tmp_path / "run", "train.epochs=1", "elastic.enabled=true")]
    cmd = [str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(script), "--gloo", str(BIN / "python"), *program]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert time.monotonic() - start < 200
    assert "lists one host, this one (localhost): naming the loopback interface" in result.stderr
    assert "epoch 1/1 " in result.stdout


def test_one_host_elastic_elsewhere_stops_at_once_with_what_to_add(tmp_path):
    script = discovery_script(tmp_path, "gpu-node-7")
    cmd = [str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "--host-discovery-script", str(script),
           str(BIN / "python"), "-c", "pass"]
    start = time.monotonic()
    result = run(cmd, tmp_path)
    assert time.monotonic() - start < 10
    assert result.returncode == 2
    assert last_line(result.stderr).startswith(
        f"hvdtrain launch: error: the discovery script {script} lists one host (gpu-node-7), and horovodrun's "
        "elastic driver waits for a second one unless a network interface is named: add --network-interfaces NIC")


@pytest.mark.parametrize("controller", ["--mpi", "--gloo"])
def test_a_stop_signal_to_the_launcher_alone_reaches_the_ranks_which_checkpoint(controller, tiny_data, tmp_path):
    """A scheduler's or batch script's SIGTERM to ``hvdtrain launch`` alone: it goes to this host's
    ranks, which checkpoint and exit 75, and nothing is left running. Handed to horovodrun, as it
    was, mpirun ended the ranks within a second (exit 1, no stop line)."""
    run_dir = tmp_path / "run"
    program = ["-m", "hvdtrain", *tiny(tiny_data, run_dir, "train.epochs=1000")]
    job = subprocess.Popen(launched(controller, program), cwd=tmp_path, env=job_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = wait_for_line(job, "epoch 1/1000 ")
        job.send_signal(signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 75, output
    assert "stopped by SIGTERM in epoch" in output and "Traceback" not in output, output
    assert rank_pids(str(run_dir)) == {}


def helpers_of(pids: set[int]) -> tuple[list[int], list[int]]:
    """The forkservers the processes ``pids`` started, and the loader workers those forked (the
    same argv): every one carries the PID of the process in ``pids`` that takes its stop signals."""
    servers, workers = [], []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        taker = next((v.split(b"=", 1)[1] for v in environ if v.startswith(b"HVDTRAIN_SIGNALS_TAKER=")), b"")
        if b"forkserver" in argv and taker.isdigit() and int(taker) in pids:
            (servers if parent in pids else workers).append(int(entry.name))
    return servers, workers


def test_a_stop_signal_reaches_ranks_with_forkserver_loader_workers_at_once(tiny_data, tmp_path):
    """The default loader (workers started by a forkserver, which never catches a stop signal): the
    launcher passes a SIGTERM on at once, as its own line says, and the ranks checkpoint and exit 75.
    It used to wait for the forkserver to catch it, up to 30 s, past many a scheduler's grace time."""
    run_dir = tmp_path / "run"
    program = ["-m", "hvdtrain", *tiny(tiny_data, run_dir, "train.epochs=1000", "data.workers=1")]
    job = subprocess.Popen(launched("--gloo", program), cwd=tmp_path, env=job_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = wait_for_line(job, "epoch 1/1000 ")
        ranks = set(rank_pids(str(run_dir)).values())
        servers, workers = helpers_of(ranks)
        assert len(ranks) == 2 and len(servers) == 2 and len(workers) >= 2, (ranks, servers, workers)
        job.send_signal(signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 75, output
    assert "hvdtrain launch: SIGTERM passed on to ranks 0, 1 on this host at once, all of them catching it" \
        in output.splitlines(), output
    assert "stopped by SIGTERM in epoch" in output and "Traceback" not in output, output
    assert rank_pids(str(run_dir)) == {}


def test_ctrl_c_at_the_terminal_stops_the_ranks_with_a_checkpoint_naming_sigint(tiny_data, tmp_path):
    """A Ctrl-C reaches the terminal's whole foreground process group. horovodrun used to be in it
    and ended the ranks with SIGTERM, so the stop line said SIGTERM; hvdtrain launch now keeps
    horovodrun out of its group and passes the Ctrl-C on as SIGINT: checkpoint, exit 75, named."""
    run_dir = tmp_path / "run"
    program = ["-m", "hvdtrain", *tiny(tiny_data, run_dir, "train.epochs=1000")]
    job = subprocess.Popen(launched("--gloo", program), cwd=tmp_path, env=job_env(tmp_path), process_group=0,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = wait_for_line(job, "epoch 1/1000 ")
        os.killpg(job.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 75, output
    assert "stopped by SIGINT (Ctrl-C) in epoch" in output and "stopped by SIGTERM" not in output, output
    assert "Traceback" not in output and rank_pids(str(run_dir)) == {}


def test_two_stop_signals_while_the_ranks_start_end_in_a_checkpoint(tiny_data, tmp_path):
    """SIGTERM twice within 100 ms while the ranks are still starting (a batch shell and its helper
    step, or scontrol requeue, may send two): the launcher hands one to each rank once the rank
    catches it, and the ranks stop at their first step with a checkpoint and 75. Before, the second
    signal crashed the launcher (psutil half-imported in its handler) or the first ended the ranks."""
    run_dir = tmp_path / "run"
    program = ["-m", "hvdtrain", *tiny(tiny_data, run_dir, "train.epochs=12")]
    job = subprocess.Popen(launched("--gloo", program), cwd=tmp_path, env=job_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not rank_pids(str(run_dir)) and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)  # the ranks' processes exist: they are importing Python, torch and Horovod
        job.send_signal(signal.SIGTERM)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=180)
    finally:
        job.kill()
    assert job.returncode == 75, output
    # Every rank of this host gets it (none is left to hear of it from the others) once all have started.
    assert output.count("stopped by SIGTERM in epoch 1/12 at step 0/") >= 1 and "Traceback" not in output, output
    assert "rank 0: stopped by SIGTERM in epoch 1/12 at step 0/" in output.splitlines()[-1], output
    assert f"checkpoint saved to {run_dir}/checkpoints/" in output.splitlines()[-1], output
    assert (run_dir / "checkpoints" / "last.pt").exists() and rank_pids(str(run_dir)) == {}
