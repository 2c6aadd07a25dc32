"""Data that vanishes mid-run, really launched on 2 ranks (tests/parallel/test_vanishing_data.py has
the image-folder training case):

* a tar shard deleted during epoch 1, before any rank opened it: both ranks stop before the step
  that needs it, with exit code 65, one line naming the shard and a checkpoint of the last good
  step; with the shard back, the same command resumes there and ends bitwise where an
  uninterrupted run ends;
* a validation class folder emptied during epoch 1 (a quarter of the split): both ranks stop with
  exit code 65 after the epoch's training is checkpointed, and nothing of that validation is
  recorded; with the files back, the same command validates epoch 1 again and ends bitwise where
  an uninterrupted run ends, with the same records.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

from hvdtrain.checkpoint import io as checkpoint
from hvdtrain.data.demo import generate
from hvdtrain.data.shards.manifest import join, read_manifest
from hvdtrain.data.shards.order import epoch_sequence
from tests.helpers import BIN, DEBUG, PROBE, VANISHING, assert_bitwise_equal, final_states, job_env, launch


def stopped_run(tmp_path: Path, args: list[str], path: Path, step: int) -> tuple[subprocess.CompletedProcess, str]:
    """The job under hvdtrain launch (its exit code is the ranks'), with ``path`` deleted after ``step``."""
    driver = tmp_path / "vanishing.py"
    driver.write_text(VANISHING)
    stopped = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2",
                              "--gloo", str(BIN / "python"), str(driver), *args], cwd=tmp_path,
                             env={**job_env(tmp_path), "VANISH_AT_STEP": str(step), "VANISH_PATH": str(path)},
                             capture_output=True, text=True, timeout=600)
    return stopped, stopped.stdout + stopped.stderr


def the_line(stopped: subprocess.CompletedProcess, output: str, text: str) -> str:
    """Rank 0's one line, which hvdtrain launch's last line repeats; no traceback anywhere."""
    assert stopped.returncode == 65, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    lines = [line for line in output.splitlines() if text in line]
    assert len(lines) == 2, output[-4000:]
    line = lines[0][lines[0].index("hvdtrain: "):]
    assert lines[1] == [entry for entry in stopped.stderr.splitlines() if entry.strip()][-1]
    assert lines[1].startswith("hvdtrain launch: exit 65 (data files vanished") and lines[1].endswith(line)
    return line


def test_a_shard_vanishing_in_epoch_1_stops_both_ranks_before_it_and_the_rerun_resumes_exactly(tmp_path):
    source = tmp_path / "images"
    generate(source, train_per_class=24, val_per_class=3, size=32, num_classes=4)
    from hvdtrain.tools.prepare import prepare

    data = tmp_path / "shards"
    prepare(source, data, shard_size_mb=0.03, progress=False)
    manifest = read_manifest(str(data))
    # The last shard of epoch 1's order: the end of rank 1's half (records 36-47 of its 48 at the
    # most), which its stream needs from batch 4 on (shuffle buffer 4). When the deletion comes,
    # after step 1, the stream has read batches 0-2 (batch 2 held ahead, counted, not taken).
    sequence = epoch_sequence(manifest.train, seed=0, epoch=0)
    last = int(np.searchsorted(manifest.train.offsets, sequence[-1], side="right") - 1)
    assert len(manifest.train.names) >= 6 and manifest.train.counts[last] <= 12
    shard = Path(join(str(data), manifest.train.names[last]))
    backup = tmp_path / "backup.tar"
    shutil.copy(shard, backup)
    # 96 images, 2 ranks x 8: 6 steps. No loader workers (what a worker sends is the same batch,
    # pickled: tests/unit/test_vanishing_shards.py), which keeps the three jobs short.
    args = DEBUG + [f"data.dir={data}", "train.steps_per_epoch=0", "train.epochs=1", "data.shuffle_buffer=4",
                    "output.tensorboard=false"]
    launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "expected"), *args,
                                  f"output.dir={tmp_path / 'uninterrupted'}"], tmp_path)

    run_dir = tmp_path / "run"
    stopped, output = stopped_run(tmp_path, [*args, f"output.dir={run_dir}"], shard, step=1)
    line = the_line(stopped, output, "training data vanished")
    found = re.fullmatch(rf"hvdtrain: training data vanished: shard {re.escape(str(shard))} cannot be read "
                         r"\(missing: FileNotFoundError: No such file or directory\), and epoch 1 needs it\. "
                         r"Stopped before global step (\d+) \(epoch 1, step (\d+)/6\): the checkpoint of the last "
                         rf"good step is {re.escape(str(run_dir / 'checkpoints'))}/step-(\d+)\.pt, the failed files "
                         rf"are listed in {re.escape(str(run_dir / 'bad_files.jsonl'))}\. Restore the shards "
                         r"\(remount the volume\), then run the same command to resume", line)
    assert found, line
    next_step, next_in_epoch, saved_step = (int(value) for value in found.groups())
    stop_step = next_step - 1
    assert next_in_epoch == next_step and saved_step == stop_step and 2 <= stop_step <= 5
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert saved["step"] == stop_step and saved["epoch"] == 0   # the last good step, not the hole's
    assert saved["shard_loader"]["total"] == stop_step * 16      # the batches trained on, none held ahead
    listed = [json.loads(entry) for entry in (run_dir / "bad_files.jsonl").read_text().splitlines()]
    assert listed == [{"epoch": 0, "split": "train", "reason": "missing", "path": str(shard),
                       "error": "FileNotFoundError: No such file or directory"}]
    assert "skipping" not in output   # the shard is named once, in the line

    shutil.copy(backup, shard)   # the volume is back
    resumed = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "resumed"), *args, f"output.dir={run_dir}"],
                     tmp_path)
    assert f"at epoch 1, step {stop_step}/6 (global step {stop_step})" in resumed.stdout, resumed.stdout[-3000:]
    for expected, got in zip(final_states(tmp_path / "expected"), final_states(tmp_path / "resumed")):
        assert_bitwise_equal(expected, got)


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_vanished_validation_folder_stops_after_the_training_checkpoint_and_the_rerun_validates_again(tmp_path):
    data = tmp_path / "data"
    generate(data, train_per_class=8, val_per_class=6, size=32, num_classes=4)
    folder = data / "val" / sorted(p.name for p in (data / "val").iterdir())[1]
    backup = tmp_path / "backup"
    shutil.copytree(folder, backup)
    # 32 training images, 2 ranks x 8: 2 steps per epoch; 24 validation images, 6 in the folder.
    args = DEBUG + [f"data.dir={data}", "train.steps_per_epoch=0", "train.epochs=2", "output.tensorboard=false"]
    launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "expected"), *args,
                                  f"output.dir={tmp_path / 'uninterrupted'}"], tmp_path)

    run_dir = tmp_path / "run"
    stopped, output = stopped_run(tmp_path, [*args, f"output.dir={run_dir}"], folder, step=1)
    line = the_line(stopped, output, "validation data vanished")
    assert re.fullmatch(
        rf"hvdtrain: validation data vanished: 6 of the 24 validation samples failed in epoch 1 \(25\.0%: 6 missing; "
        rf"data\.max_bad_fraction=0\.01 allows 0\); most in {re.escape(str(folder))}/ \(6\); first missing: "
        rf"{re.escape(str(folder))}/\S+\.JPEG\. Epoch 1's training is saved, not validated \(its metrics would leave "
        rf"those samples out\), in {re.escape(str(run_dir / 'checkpoints' / 'step-00000002.pt'))}; the failed "
        rf"files are listed in {re.escape(str(run_dir / 'bad_files.jsonl'))}\. Restore the data \(remount the "
        r"volume\), then run the same command: it resumes there and validates epoch 1 again; or raise "
        r"data\.max_bad_fraction", line), line
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert (saved["epoch"], saved["step"], saved["step_in_epoch"]) == (0, 2, 2)   # trained, not validated
    assert saved["best_metric"] is None and not (run_dir / "checkpoints" / "best.pt").exists()
    assert not [r for r in records(run_dir) if r.get("split") in ("train", "val")]   # nothing of epoch 1 recorded
    listed = [json.loads(entry) for entry in (run_dir / "bad_files.jsonl").read_text().splitlines()]
    assert len(listed) == 6 and all(e["split"] == "val" and e["reason"] == "missing" and
                                    Path(e["path"]).parent == folder for e in listed)

    shutil.rmtree(folder)
    shutil.copytree(backup, folder)   # the mount is back
    resumed = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "resumed"), *args, f"output.dir={run_dir}"],
                     tmp_path)
    assert "at epoch 1, step 2/2 (global step 2)" in resumed.stdout, resumed.stdout[-3000:]
    for expected, got in zip(final_states(tmp_path / "expected"), final_states(tmp_path / "resumed")):
        assert_bitwise_equal(expected, got)
    keys = ("epoch", "step", "loss", "top1", "top5", "samples", "bad_files")
    ours = [{k: r.get(k) for k in keys} for r in records(run_dir) if r.get("split") in ("train", "val")]
    theirs = [{k: r.get(k) for k in keys} for r in records(tmp_path / "uninterrupted") if r.get("split") in
              ("train", "val")]
    assert ours == theirs and [r["samples"] for r in ours if r["epoch"] == 0] == [32, 24]
