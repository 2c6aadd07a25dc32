"""How a job ends under the raw launchers, torchrun (torch engine) and horovodrun (Horovod engine,
Gloo), on 2 ranks: a stop after a checkpoint reads as a stop (exit 0, rank 0's last line says so and
how to resume, the other rank quiet, no traceback), and a config error is one line from rank 0 with
exit 2 on every rank. The parts that need no launch: tests/unit/test_raw_launchers.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers import job_env, launch_command, rank_pids, tiny, wait_for_line

ENGINE = {"torchrun": ["dist.engine=torch"], "horovodrun-gloo": []}
NAME = {"torchrun": "torchrun", "horovodrun-gloo": "horovodrun"}
PREFIX = {"torchrun": "", "horovodrun-gloo": "[0]<stdout>:"}  # horovodrun tags each rank's lines


def lines_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("kind", ["torchrun", "horovodrun-gloo"])
def test_a_checkpointed_stop_exits_0_with_rank_0s_line_last_and_no_traceback(kind, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # More epochs than the job reaches before the stop lands, whatever the machine's speed.
    program = ["-m", "hvdtrain", *tiny(tiny_data, run_dir, "train.epochs=1000", *ENGINE[kind])]
    job = subprocess.Popen(launch_command(kind, 2, program), cwd=tmp_path, env=job_env(tmp_path),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        before = wait_for_line(job, "epoch 1/1000 ")
        pids = rank_pids(str(run_dir))
        assert sorted(pids) == [0, 1], pids
        for pid in pids.values():  # a scheduler's stop reaches every rank
            os.kill(pid, signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(before) + rest
    assert job.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    after = lines_of(rest)
    assert after[-1] == (f"{PREFIX[kind]}hvdtrain: stopped after a checkpoint: run the same command to resume (exit "
                         f"0: {NAME[kind]} would report exit 75 as a failure, with a traceback; hvdtrain launch and "
                         f"srun exit 75)"), output[-3000:]
    stop = [line for line in after if "hvdtrain: stopped by SIGTERM in epoch" in line]
    assert len(stop) == 1 and stop[0].startswith(PREFIX[kind]) and after[-2] == stop[0], output[-3000:]
    if kind == "horovodrun-gloo":  # the other rank says nothing of the stop
        assert not [line for line in after if line.startswith("[1]")], output[-3000:]
    assert (run_dir / "checkpoints" / "last.pt").is_file()


@pytest.mark.parametrize("kind", ["torchrun", "horovodrun-gloo"])
def test_a_config_error_is_one_line_from_rank_0_and_exit_2_on_every_rank(kind, tiny_data, tmp_path):
    program = ["-m", "hvdtrain", *tiny(tiny_data, tmp_path / "run", "train.epochs=abc", *ENGINE[kind])]
    started = time.monotonic()
    result = subprocess.run(launch_command(kind, 2, program), cwd=tmp_path, env=job_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    said = [line for line in lines_of(output) if "expects int, got 'abc'" in line]
    assert said == [f"{PREFIX[kind].replace('stdout', 'stderr')}hvdtrain: error: config key 'train.epochs' expects "
                    f"int, got 'abc'"], output[-3000:]
    assert "error on rank" not in output and "hvdtrain/" not in output, output[-3000:]  # no rank's traceback
    if kind == "torchrun":  # its failure report lists every rank's code
        codes = re.findall(r"exitcode\s+:\s*(-?\d+)", output)  # not its log line "(exitcode: 2)"
    else:
        codes = [code for _, code in re.findall(r"Process (\d) exit with status code (-?\d+)\.", output)]
    assert codes and len(codes) == 2 and set(codes) == {"2"}, output[-3000:]
    # Not the other rank's 10 s wait for a line of its own (outcome.PEER_PAUSE_SECONDS).
    assert elapsed < 60, f"{elapsed:.0f} s"
