"""``hvdtrain ray`` on a real two-node Ray cluster on this machine (tests/parallel/ray_cluster.py):
one rank per node, trained like horovodrun trains; a killed rank ends the job; SIGTERM on the
driver checkpoints every rank and a rerun resumes; no actor or placement group outlives a job."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import BIN, PROBE, job_env, launch, training_processes, wait_for_line

pytest.importorskip("ray", reason="Ray is not installed (pip install -e .[ray] or make setup EXTRAS=ray)")

from tests.parallel.ray_cluster import ADDRESS, HEAD_IP, RENDEZVOUS_PORT, WORKER_IP, RayCluster, can_bind  # noqa: E402

# The debug config for 3 epochs of 4 steps, a checkpoint every 3 steps: time to stop it mid-run.
TRAIN = ["--config", "debug", "train.epochs=3", "checkpoint.every_steps=3"]
JOB_SECONDS = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not (can_bind(HEAD_IP) and can_bind(WORKER_IP)):
        pytest.skip(f"cannot bind {HEAD_IP} and {WORKER_IP} (loopback aliases) on this machine")
    ray_cluster = RayCluster(tmp_path_factory.mktemp("ray"))
    try:
        ray_cluster.start()
        yield ray_cluster
    finally:
        ray_cluster.stop()


def ray_command(program: list[str], probe_dir: Path | None = None) -> list[str]:
    """The driver's command line: one rank per node (1 CPU + the node's one hvd_slot)."""
    script = ["--script", str(PROBE), "--", str(probe_dir)] if probe_dir else ["--"]
    return [str(BIN / "python"), "-m", "hvdtrain", "ray", "-np", "2", "--address", ADDRESS, "--resource",
            "hvd_slot=1", "--strategy", "spread", "--rendezvous-port", str(RENDEZVOUS_PORT),
            "--placement-timeout", "120", *script, *program]


def run_ray(program: list[str], tmp: Path, probe_dir: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(ray_command(program, probe_dir), cwd=tmp, env=job_env(tmp), capture_output=True,
                          text=True, timeout=JOB_SECONDS)


def start_ray(program: list[str], tmp: Path) -> subprocess.Popen:
    return subprocess.Popen(ray_command(program), cwd=tmp, env=job_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def load_ranks(probe_dir: Path) -> list[dict]:
    return [torch.load(probe_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert different == [], f"{len(different)} tensors differ, e.g. {different[:3]}"


def assert_released() -> None:
    """No actor alive and no placement group left: Ray's state API, from outside the job."""
    from ray.util.state import list_actors, list_placement_groups

    deadline = time.monotonic() + 30
    while True:
        actors = [a for a in list_actors(address=ADDRESS, limit=1000) if a.state != "DEAD"]
        groups = [g for g in list_placement_groups(address=ADDRESS, limit=1000) if g.state != "REMOVED"]
        if not actors and not groups:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"leaked: {actors} {groups}")
        time.sleep(1)


def test_two_nodes_train_like_horovodrun(cluster, tiny_data, tmp_path):
    run_dir, probe_dir = tmp_path / "ray-run", tmp_path / "ray-probe"
    done = run_ray(TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}"], tmp_path, probe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"2 ranks on 2 node(s) ({HEAD_IP}, {WORKER_IP})" in done.stderr or \
        f"2 ranks on 2 node(s) ({WORKER_IP}, {HEAD_IP})" in done.stderr
    assert "epoch 3/3 " in done.stdout + done.stderr  # rank 0's output streamed to the driver
    ranks = load_ranks(probe_dir)
    assert [(r["rank"], r["size"], r["local_rank"], r["controller"]) for r in ranks] == [(0, 2, 0, "gloo"),
                                                                                         (1, 2, 0, "gloo")]
    assert_bitwise_equal(ranks[0]["state"], ranks[1]["state"])
    assert ranks[0]["step"] == ranks[1]["step"] == 12
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in records if r["split"] == "val"] == [21, 21, 21]  # every image once
    assert [r["samples"] for r in records if r["split"] == "train"] == [64, 64, 64]

    # The same config under horovodrun (two ranks on one host): the same parameters, bit for bit.
    reference = tmp_path / "horovodrun-probe"
    launch("horovodrun-gloo", 2, [str(PROBE), str(reference)] + TRAIN +
           [f"data.dir={tiny_data}", f"output.dir={tmp_path / 'horovodrun-run'}"], tmp_path)
    assert_bitwise_equal(load_ranks(reference)[0]["state"], ranks[0]["state"])
    assert_released()


def test_a_killed_rank_ends_the_job_naming_rank_and_node(cluster, tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    job = start_ray(TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}"], tmp_path)
    try:
        lines = wait_for_line(job, "epoch 1/3 ", timeout=JOB_SECONDS)
        ranks = {int(env["HOROVOD_RANK"]): (pid, env["HOROVOD_HOSTNAME"])
                 for pid, env in training_processes(str(run_dir)).items() if "HOROVOD_RANK" in env}
        assert sorted(ranks) == [0, 1], ranks
        pid, node = ranks[1]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        rest, _ = job.communicate(timeout=90)
        elapsed = time.monotonic() - killed
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 1, output[-3000:]
    assert elapsed < 60, f"took {elapsed:.0f} s"
    assert f"rank 1 on node {node} failed: it exited with signal SIGKILL" in output
    assert not training_processes(str(run_dir))  # rank 0 did not stay behind
    assert_released()


@pytest.mark.slow
def test_sigterm_on_the_driver_checkpoints_every_rank_and_a_rerun_resumes(cluster, tiny_data, tmp_path):
    # The ranks agree on a stop about every 0.5 s of steps, read at the latest at an epoch's end, and
    # the driver passes the signal on at its next poll: the first leg asks for more epochs than it can
    # reach before that, on any machine; the rerun ends with the epoch the checkpoint is in
    # (train.epochs may change between legs).
    run_dir = tmp_path / "run"
    train = TRAIN + [f"data.dir={tiny_data}", f"output.dir={run_dir}"]
    job = start_ray([*train, "train.epochs=1000"], tmp_path)
    try:
        lines = wait_for_line(job, "epoch 1/1000 ", timeout=JOB_SECONDS)
        job.send_signal(signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 75, output[-3000:]
    assert "SIGTERM: asking every rank to checkpoint and stop" in output
    assert "Resume with the same command" in output
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["step"] >= 4  # after epoch 1's line
    assert_released()

    epochs = saved["epoch"] + 1  # the epoch the checkpoint is in, or one more after an epoch's end
    probe_dir = tmp_path / "probe"
    done = run_ray([*train, f"train.epochs={epochs}"], tmp_path, probe_dir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resumed from" in done.stdout
    ranks = load_ranks(probe_dir)
    assert ranks[0]["step"] == ranks[1]["step"] == 4 * epochs
    assert_bitwise_equal(ranks[0]["state"], ranks[1]["state"])
