"""A spot interruption notice stops a really launched 2-rank job like SIGTERM does: every rank
checkpoints at the same step, the job stops with exit code 75 within 30 s of the notice, and the
same command resumes bitwise-exactly. The notice comes from a real HTTP server on loopback
answering as AWS IMDSv2."""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch

from tests.helpers import PROBE, assert_bitwise_equal, final_states, launch, start_job
from tests.metadata_server import AWS_TOKEN, metadata_server

# 4 epochs of 4 steps, a checkpoint every 3 steps and at each epoch's end. 4 epochs, not 2: the
# ranks agree on a stop about every 0.5 s of steps, read at the latest at an epoch's end, so a notice
# seen early in the last epoch could stop nothing (the run had finished). The watchdog's 45 s without
# progress is too short on a machine loaded by other jobs; it plays no part here, so it gets room.
ARGS = ["--config", "debug", "data.workers=0", "checkpoint.every_steps=3", "checkpoint.keep=100",
        "train.epochs=4", "dist.timeout_seconds=300"]


def args(tiny_data: Path, run_dir: Path, *extra: str) -> list[str]:
    return ARGS + [f"data.dir={tiny_data}", f"output.dir={run_dir}", *extra]


def test_an_aws_spot_notice_checkpoints_every_rank_and_resume_is_exact(tiny_data, tmp_path):
    launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "straight_probe")]
           + args(tiny_data, tmp_path / "straight"), tmp_path)
    expected = final_states(tmp_path / "straight_probe")[0]

    run_dir = tmp_path / "run"
    with metadata_server("aws") as server:
        notice = ["runtime.preemption_notice=aws", f"runtime.preemption_notice_url={server.url}",
                  "runtime.preemption_poll_seconds=0.2"]
        job = start_job("horovodrun-gloo", [str(PROBE), str(tmp_path / "probe")] + args(tiny_data, run_dir, *notice),
                        tmp_path)
        try:
            # The notice appears mid-run: once the step-3 checkpoint exists (13 of 16 steps to go).
            deadline = time.monotonic() + 600
            while not (run_dir / "checkpoints" / "step-00000003.pt").exists():
                assert job.poll() is None and time.monotonic() < deadline, "the job ended before step 3"
                time.sleep(0.05)
            polls_before = sum(1 for r in server.requests if r[0] == "GET")
            server.notice.set()
            sent = time.monotonic()
            output, _ = job.communicate(timeout=60)
            elapsed = time.monotonic() - sent
        finally:
            job.kill()
        requests = list(server.requests)
    assert elapsed < 30, f"took {elapsed:.1f}s to stop after the notice"
    # horovodrun reports a failure (it passes no code through) and ends the other ranks as soon as
    # one exits with an error code. So the first rank to exit shows 75, and so does every rank that
    # ended on its own; one still on its way out (the ranks leave together, after every write) may
    # be ended by horovodrun's SIGTERM (143), but only after the first exit.
    assert job.returncode != 0
    codes = re.findall(r"Process (\d) exit with status code (\d+)\.", output)
    ended = output.find("Terminating remaining workers")
    assert codes and codes[0][1] == "75", output[-2000:]
    assert all(code == "75" or (code == "143" and 0 <= ended < output.find(f"Process {rank} exit"))
               for rank, code in codes), output[-2000:]
    assert output.count(f"hvdtrain: watching for aws preemption notices at {server.url} every 0.2 s") == 1
    assert ("stopped by an AWS spot interruption notice (terminate at 2026-11-23T04:12:00Z)" in output
            or "stopped by a preemption notice (aws) seen by another rank" in output), output[-2000:]
    assert "Resume with the same command" in output
    # Both ranks polled (IMDSv2: a token each, then GETs with it) while training went on.
    assert sum(1 for r in requests if r[0] == "PUT") == 2
    assert polls_before >= 2 and all(r[2]["x-aws-ec2-metadata-token"] == AWS_TOKEN for r in requests if r[0] == "GET")
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert 3 <= saved["step"] < 16
    assert not (tmp_path / "probe").exists()  # the job did not run to the end

    # The same command resumes (the endpoint is gone now: one line, and training goes on).
    resumed = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe")]
                     + args(tiny_data, run_dir, *notice), tmp_path)
    assert "resumed from" in resumed.stdout
    assert resumed.stdout.count("hvdtrain: the aws metadata endpoint does not answer (") == 1
    assert_bitwise_equal(final_states(tmp_path / "probe")[0], expected)
