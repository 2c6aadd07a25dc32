"""Fault tolerance, with really launched 2-rank jobs: exact resume, corrupt checkpoints,
preemption by signal, a different number of ranks, and dead or hung ranks (no silent hangs)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hvdtrain.data.demo import class_names
from tests.helpers import (
    PROBE,
    assert_bitwise_equal,
    final_states,
    job_env,
    launch,
    rank_pids,
    start_job,
    wait_for_line,
)

# These tests need autocast's state (the GradScaler) but not learning. Without bf16/fp16 instructions
# (AVX2 machines such as CI's) autocast convolutions fall back to PyTorch's slow kernels: a resnet18
# step at 32 px took 4.5 s there instead of 0.17 s in float32; this model's takes 0.24 s. (It does not
# learn the tiny data in 24 steps, so test_training.py's AMP learning tests keep resnet18.)
AMP_ARCH = "shufflenet_v2_x0_5"
# Augmentation on, a loader worker per rank, fp16 AMP (GradScaler state), mid-epoch checkpoints
# every 3 steps with 4 steps per epoch: checkpoints at steps 3, 4, 6, 8, 9, 12.
RESUMABLE = ["--config", "debug", f"model.arch={AMP_ARCH}", "data.workers=1", "amp.enabled=true",
             "amp.dtype=float16", "checkpoint.every_steps=3", "checkpoint.keep=100", "train.epochs=3"]


def args(tiny_data: Path, run_dir: Path, *extra: str) -> list[str]:
    return RESUMABLE + [f"data.dir={tiny_data}", f"output.dir={run_dir}", *extra]


def uninterrupted(kind: str, tiny_data: Path, tmp: Path) -> tuple[Path, dict]:
    launch(kind, 2, [str(PROBE), str(tmp / "probe")] + args(tiny_data, tmp / "run"), tmp)
    states = final_states(tmp / "probe")
    assert_bitwise_equal(states[0], states[1])
    return tmp / "run", states[0]


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    """The uninterrupted run every resumed run is compared with (Gloo controller)."""
    return uninterrupted("horovodrun-gloo", tiny_data, tmp_path_factory.mktemp("straight"))


@pytest.fixture(scope="module")
def straight_mpi(tiny_data, tmp_path_factory):
    """The same under the MPI controller: its averages round differently from Gloo's in the last bit."""
    return uninterrupted("mpirun", tiny_data, tmp_path_factory.mktemp("straight_mpi"))


def resume_from(tiny_data: Path, straight_dir: Path, checkpoint: str, tmp: Path) -> dict:
    run_dir = tmp / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(straight_dir / "checkpoints" / checkpoint, run_dir / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp / "probe")] + args(tiny_data, run_dir), tmp)
    assert "resumed from" in result.stdout
    states = final_states(tmp / "probe")
    assert_bitwise_equal(states[0], states[1])
    return states[0]


def train_records(run_dir: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["epoch"]: r for r in records if r["split"] == "train"}


def assert_whole_epochs(run_dir: Path, straight_dir: Path, epochs: list[int]) -> None:
    """Every epoch's train record, an interrupted and resumed one too, covers the whole epoch, with
    the uninterrupted run's loss (the same sums, added in another order)."""
    resumed, expected = train_records(run_dir), train_records(straight_dir)
    assert sorted(resumed) == epochs and sorted(expected) == [0, 1, 2]
    for epoch, record in resumed.items():
        assert record["samples"] == expected[epoch]["samples"] == 64, (epoch, record["samples"])  # 4 steps of 16
        assert record["loss"] == pytest.approx(expected[epoch]["loss"], rel=1e-9, abs=0), epoch
        assert record["top1"] == expected[epoch]["top1"], epoch


@pytest.mark.parametrize("checkpoint", ["step-00000003.pt", "step-00000008.pt"],
                         ids=["mid-epoch", "epoch-end"])
def test_resume_is_bitwise_identical_to_the_uninterrupted_run(checkpoint, straight, tiny_data, tmp_path):
    straight_dir, expected = straight
    assert_bitwise_equal(resume_from(tiny_data, straight_dir, checkpoint, tmp_path), expected)
    if checkpoint == "step-00000003.pt":  # 3 of epoch 1's 4 steps (48 of 64 samples) were trained by the first job
        carried = torch.load(straight_dir / "checkpoints" / checkpoint, weights_only=True)["train_sums"]
        assert carried[-1] == 48  # the image task's sums end with the sample count
    assert_whole_epochs(tmp_path / "run", straight_dir, [0, 1, 2] if checkpoint == "step-00000003.pt" else [2])


def test_checkpoint_contents_and_retention(straight):
    directory = straight[0] / "checkpoints"
    names = sorted(p.name for p in directory.iterdir())
    assert names == ["best.pt", "last.pt"] + [f"step-{s:08d}.pt" for s in (3, 4, 6, 8, 9, 12)]
    assert os.path.samefile(directory / "last.pt", directory / "step-00000012.pt")
    saved = torch.load(directory / "step-00000003.pt", weights_only=True)
    assert (saved["epoch"], saved["step_in_epoch"], saved["samples_in_epoch"], saved["step"]) == (0, 3, 48, 3)
    assert saved["format"] == 3 and saved["task"] == {"name": "image_classification", "arch": AMP_ARCH,
                                                       "num_classes": 4, "classes": sorted(class_names()[:4])}
    assert saved["scaler"]["scale"] > 0 and saved["world_size"] == 2 and len(saved["ranks"]) == 2
    assert all({"torch", "python", "numpy"} <= set(rank["rng"]) for rank in saved["ranks"])
    # Mid-epoch, every rank's own BatchNorm statistics are kept (they are averaged at epoch ends).
    assert all("conv1.1.running_mean" in rank["buffers"] for rank in saved["ranks"])
    assert not any(key.startswith("module.") for key in saved["model"])
    metrics = [json.loads(line) for line in (straight[0] / "metrics.jsonl").read_text().splitlines()]
    best_epoch = max((m for m in metrics if m["split"] == "val"), key=lambda m: m["top1"])
    best = torch.load(directory / "best.pt", weights_only=True)
    assert best["step"] == best_epoch["step"]


def test_keep_prunes_old_numbered_checkpoints(tmp_path):
    from hvdtrain.checkpoint.io import CheckpointSaver

    saver = CheckpointSaver(tmp_path, keep=2)
    for step in (1, 2, 3):
        saver.save({"step": step, "model": {}, "optimizer": {}, "epoch": 0, "config": {}}, is_best=step == 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt", "last.pt", "step-00000002.pt",
                                                          "step-00000003.pt"]
    assert torch.load(tmp_path / "best.pt", weights_only=True)["step"] == 2


def test_corrupt_last_checkpoint_falls_back_to_the_newest_good_one(straight, tiny_data, tmp_path):
    straight_dir, expected = straight
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    for name in ("step-00000003.pt", "step-00000008.pt"):
        shutil.copy(straight_dir / "checkpoints" / name, run_dir / "checkpoints" / name)
    good = (straight_dir / "checkpoints" / "step-00000009.pt").read_bytes()
    (run_dir / "checkpoints" / "last.pt").write_bytes(good[: len(good) // 2])          # truncated
    (run_dir / "checkpoints" / "step-00000009.pt").write_bytes(b"not a checkpoint")     # garbage
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe")] + args(tiny_data, run_dir), tmp_path)
    output = result.stdout + result.stderr
    assert f"checkpoint '{run_dir / 'checkpoints' / 'last.pt'}' is unreadable" in output
    assert f"checkpoint '{run_dir / 'checkpoints' / 'step-00000009.pt'}' is unreadable" in output
    assert f"resumed from {run_dir / 'checkpoints' / 'step-00000008.pt'}" in output
    assert_bitwise_equal(final_states(tmp_path / "probe")[0], expected)


def as_format_2(payload: dict) -> dict:
    """A checkpoint as hvdtrain wrote it before the run state protocol (format 2)."""
    old = {key: value for key, value in payload.items() if key not in ("ranks", "best_metric", "task")}
    old.update(format=2, best_top1=payload["best_metric"], rng=[rank["rng"] for rank in payload["ranks"]],
               rank_buffers=[rank["buffers"] for rank in payload["ranks"]] if payload["step_in_epoch"] else None)
    return old


def test_a_format_2_checkpoint_still_resumes_exactly(straight, tiny_data, tmp_path):
    straight_dir, expected = straight
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    saved = torch.load(straight_dir / "checkpoints" / "step-00000006.pt", weights_only=True)
    torch.save(as_format_2(saved), run_dir / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe")] + args(tiny_data, run_dir), tmp_path)
    assert f"resumed from {run_dir / 'checkpoints' / 'last.pt'} at epoch 2, step 2/4" in result.stdout
    assert_bitwise_equal(final_states(tmp_path / "probe")[0], expected)


WRITER = """
import os, sys, time
from pathlib import Path
import torch
from hvdtrain.checkpoint.io import atomic_save

def stall(*args):
    print("writing", flush=True)
    time.sleep(600)

class Stalls:
    def __reduce__(self):
        stall()

if sys.argv[2] == "fsync":
    os.fsync = stall  # every byte written, not yet renamed: the last moment before the swap
payload = {"model": {"w": torch.zeros(1 << 20)}, "step": 9}
if sys.argv[2] == "pickling":
    payload["stall"] = Stalls()  # the new file made, its records still being pickled
atomic_save(payload, Path(sys.argv[1]))
"""


@pytest.mark.parametrize("moment", ["pickling", "fsync"])
def test_a_crash_while_writing_keeps_the_previous_checkpoint(moment, tmp_path):
    """A writer SIGKILLed in the middle of a checkpoint (as the OOM killer or a node's power does):
    the previous file is whole, and the next save goes through."""
    from hvdtrain.checkpoint.io import atomic_save, load

    path = tmp_path / "last.pt"
    atomic_save({"model": {"w": torch.ones(3)}, "optimizer": {}, "epoch": 1, "step": 5, "config": {}}, path)
    before = path.read_bytes()
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path), moment], stdout=subprocess.PIPE, text=True,
                              env=job_env(tmp_path))
    try:
        wait_for_line(writer, "writing", timeout=120)
        (partial,) = [p for p in tmp_path.iterdir() if p.name != "last.pt"]  # the new file, not yet in place
        if moment == "fsync":
            assert partial.stat().st_size > 4 << 20  # the whole new checkpoint, one rename away
        writer.kill()
        writer.wait(timeout=60)
    finally:
        writer.kill()
    assert writer.returncode == -signal.SIGKILL
    assert path.read_bytes() == before and load(path)["step"] == 5
    atomic_save({"model": {"w": torch.ones(3)}, "optimizer": {}, "epoch": 1, "step": 6, "config": {}}, path)
    assert load(path)["step"] == 6


@pytest.mark.parametrize("kind, signum, targets", [
    ("horovodrun-gloo", signal.SIGTERM, (0, 1)),
    ("mpirun", signal.SIGUSR1, (1,)),
], ids=["sigterm-all-ranks-horovodrun", "sigusr1-one-rank-mpirun"])
@pytest.mark.timing  # a stop within 20 s: about 2 s here, the next step and a checkpoint
def test_preemption_checkpoints_and_resume_finishes_exactly(kind, signum, targets, request, tiny_data, tmp_path):
    expected = request.getfixturevalue("straight" if kind == "horovodrun-gloo" else "straight_mpi")[1]
    run_dir = tmp_path / "run"
    job = start_job(kind, [str(PROBE), str(tmp_path / "probe")] + args(tiny_data, run_dir), tmp_path)
    try:
        lines = wait_for_line(job, "epoch 1/3 ")
        pids = rank_pids(str(run_dir))
        assert sorted(pids) == [0, 1], pids
        sent = time.monotonic()
        for rank in targets:
            os.kill(pids[rank], signum)
        rest, _ = job.communicate(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode != 0
    assert elapsed < 20, f"took {elapsed:.1f}s to stop"
    name = signal.Signals(signum).name
    assert f"stopped by {name}" in output or "stopped by a stop signal sent to another rank" in output
    assert "Resume with the same command" in output
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert 4 <= saved["step"] < 12
    assert not (tmp_path / "probe").exists()  # the job did not run to the end
    launch(kind, 2, [str(PROBE), str(tmp_path / "probe")] + args(tiny_data, run_dir), tmp_path)
    assert_bitwise_equal(final_states(tmp_path / "probe")[0], expected)
    straight_dir = request.getfixturevalue("straight" if kind == "horovodrun-gloo" else "straight_mpi")[0]
    assert ("train_sums" in saved) == (saved["step_in_epoch"] > 0)
    assert_whole_epochs(run_dir, straight_dir, [0, 1, 2])


def test_resume_with_a_different_number_of_ranks(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    common = ["--config", "debug", f"data.dir={tiny_data}", f"output.dir={run_dir}", "train.steps_per_epoch=0",
              "train.epochs=2", "checkpoint.every_steps=3", "optim.warmup_epochs=1", "optim.schedule=cosine"]
    launch("horovodrun-gloo", 2, ["-m", "hvdtrain"] + common + ["train.epochs=1"], tmp_path)
    # 2 ranks x 8 = 16 images per step, 96 images: 6 steps per epoch. Keep the mid-epoch checkpoint.
    (run_dir / "checkpoints" / "last.pt").unlink()
    shutil.copy(run_dir / "checkpoints" / "step-00000003.pt", run_dir / "checkpoints" / "last.pt")
    (run_dir / "metrics.jsonl").unlink()
    single = launch("single", 1, ["-m", "hvdtrain"] + common, tmp_path)
    assert "written by 2 ranks, this job has 1" in single.stdout
    assert "at epoch 1, step 6/12" in single.stdout  # 48 images done = 6 steps of 8
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    # The resumed epoch's record covers it whole: 48 images from the checkpoint's sums, 48 trained here.
    assert [(r["epoch"], r["samples"], r["step"]) for r in train] == [(0, 96, 3 + 6), (1, 96, 3 + 6 + 12)]
    # The learning rate follows the epoch position at the new global batch (8 -> 0.4 * 8 / 256).
    from hvdtrain.config import OptimConfig
    from hvdtrain.optim.build import LRSchedule

    schedule = LRSchedule.from_config(OptimConfig(base_lr=0.4, warmup_epochs=1, schedule="cosine"), 8, 2, 12)
    assert train[0]["lr"] == pytest.approx(schedule(11))
    assert train[1]["lr"] == pytest.approx(schedule(23))


@pytest.mark.parametrize("kind, signum", [
    ("horovodrun-gloo", signal.SIGKILL), ("mpirun", signal.SIGKILL),
    ("horovodrun-gloo", signal.SIGSTOP), ("mpirun", signal.SIGSTOP),
], ids=["kill-horovodrun", "kill-mpirun", "hang-horovodrun", "hang-mpirun"])
@pytest.mark.slow
@pytest.mark.timing  # within 60 s: the watchdog's 10 s and the launcher's teardown
def test_a_dead_or_hung_rank_stops_the_job_within_60_seconds(kind, signum, tiny_data, tmp_path):
    # The watchdog's timeout is the subject of the hang cases: 10 s, short but above any step or
    # checkpoint of this run on a loaded 2-core machine (the watchdog counts a save as progress).
    run_dir = tmp_path / "run"
    job = start_job(kind, ["-m", "hvdtrain", "--config", "debug", f"data.dir={tiny_data}", f"output.dir={run_dir}",
                           "train.epochs=100", "dist.timeout_seconds=10"], tmp_path)
    try:
        lines = wait_for_line(job, "epoch 1/100 ")
        pids = rank_pids(str(run_dir))
        sent = time.monotonic()
        os.kill(pids[1], signum)
        rest, _ = job.communicate(timeout=90)
        elapsed = time.monotonic() - sent
    finally:
        job.kill()
        if signum == signal.SIGSTOP:
            for pid in pids.values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    output = "".join(lines) + rest
    assert job.returncode != 0
    assert elapsed < 60, f"took {elapsed:.1f}s"
    if signum == signal.SIGSTOP:
        # Nobody exited: hvdtrain itself must notice and name the rank that stopped answering.
        assert f"lost rank 1 ({os.uname().nodename if kind == 'mpirun' else 'localhost'}, pid {pids[1]})" in output
    elif kind == "mpirun":
        assert "process rank 1" in output and "exited on signal 9" in output
    else:
        assert "Process name: 1" in output and "Exit code: 137" in output
        # The start-up line maps ranks to hosts as ranges; ranks.tsv in the run folder names each pid.
        assert "localhost: ranks 0-1" in output
        assert f"1\tlocalhost\t{pids[1]}" in (run_dir / "ranks.tsv").read_text().splitlines()
