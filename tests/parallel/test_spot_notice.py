"""A spot interruption notice stops a really launched 2-rank job like SIGTERM does: every rank
checkpoints at the same step and exits 75 within 30 s of the notice, and the same command resumes
bitwise-exactly. The notice comes from a real HTTP server on loopback answering as AWS IMDSv2."""

from __future__ import annotations

import time

import torch

from tests.helpers import PROBE, launch, wait_for_line
from tests.metadata_server import AWS_TOKEN, metadata_server
from tests.parallel.test_fault_tolerance import args as resumable_args, assert_bitwise_equal, final_states, start_job


def args(tiny_data, run_dir, *extra: str) -> list[str]:
    # The watchdog's 45 s without progress is too short on a machine loaded by other jobs; it plays
    # no part here (and none in the numbers), so all three runs give it more room.
    return resumable_args(tiny_data, run_dir, "dist.timeout_seconds=300", *extra)


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
            lines = wait_for_line(job, "epoch 1/3 ")
            polls_before = sum(1 for r in server.requests if r[0] == "GET")
            server.notice.set()
            sent = time.monotonic()
            rest, _ = job.communicate(timeout=60)
            elapsed = time.monotonic() - sent
        finally:
            job.kill()
        requests = list(server.requests)
    output = "".join(lines) + rest
    assert elapsed < 30, f"took {elapsed:.1f}s to stop after the notice"
    assert job.returncode == 75, output[-2000:]
    assert output.count(f"hvdtrain: watching for aws preemption notices at {server.url} every 0.2 s") == 1
    assert "stopped by an AWS spot interruption notice (terminate at 2026-11-23T04:12:00Z)" in output
    assert "Resume with the same command" in output
    # Both ranks polled (IMDSv2: a token each, then GETs with it) while training went on.
    assert sum(1 for r in requests if r[0] == "PUT") == 2
    assert polls_before >= 4 and all(r[2]["x-aws-ec2-metadata-token"] == AWS_TOKEN for r in requests if r[0] == "GET")
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert 4 <= saved["step"] < 12
    assert not (tmp_path / "probe").exists()  # the job did not run to the end

    # The same command resumes (the endpoint is gone now: one line, and training goes on).
    resumed = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe")]
                     + args(tiny_data, run_dir, *notice), tmp_path)
    assert "resumed from" in resumed.stdout
    assert resumed.stdout.count("hvdtrain: the aws metadata endpoint does not answer (") == 1
    assert_bitwise_equal(final_states(tmp_path / "probe")[0], expected)
