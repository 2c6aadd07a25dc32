"""The issue's scenario, really launched on 2 ranks: the 48 files of one class folder (of 192) are
deleted during epoch 1, as an unmounted volume or a clean-up script would.

* With the default data.max_bad_fraction (1%), both ranks stop before a step would train on the
  hole, with one line (the share, the folder, the first missing file) and exit code 65; the failed
  files are listed in bad_files.jsonl, and a checkpoint of the last good step is saved. With the
  files back, the same command resumes there and ends bitwise where an uninterrupted run ends.
* With the limit off (1.0), training goes on and each epoch counts distinct files, per reason:
  exactly the deleted files that epoch 1 still had to read, and all 48 in epoch 2 (the epoch line
  used to count replacement attempts: hundreds).
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
from hvdtrain.data.files.index import build_index
from hvdtrain.data.sampler import ShardedSampler
from tests.helpers import BIN, DEBUG, PROBE, VANISHING, assert_bitwise_equal, final_states, job_env, launch

DELETE_AT_STEP = 3  # the files go after the 3rd of epoch 1's 12 steps (192 files / (2 ranks x 8))
GLOBAL_BATCH = 16


def scenario(tmp_path: Path) -> tuple[Path, Path, Path, list[str]]:
    """192 training files in 4 class folders; the folder to delete; the driver; the job's arguments."""
    data = tmp_path / "data"
    generate(data, train_per_class=48, val_per_class=3, size=40, num_classes=4)
    folder = data / "train" / sorted(p.name for p in (data / "train").iterdir())[1]
    driver = tmp_path / "vanishing.py"
    driver.write_text(VANISHING)
    args = DEBUG + [f"data.dir={data}", "train.steps_per_epoch=0", "output.tensorboard=false"]
    return data, folder, driver, args


def vanish_env(folder: Path) -> dict[str, str]:
    return {"VANISH_AT_STEP": str(DELETE_AT_STEP), "VANISH_PATH": str(folder)}


def test_files_vanishing_in_epoch_1_stop_both_ranks_at_a_good_step_and_the_rerun_resumes_exactly(tmp_path):
    data, folder, driver, args = scenario(tmp_path)
    backup = tmp_path / "backup"
    shutil.copytree(folder, backup)
    args.append("train.epochs=1")   # the rest of epoch 1 and its validation: enough to compare
    launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "expected"), *args,
                                  f"output.dir={tmp_path / 'uninterrupted'}"], tmp_path)

    run_dir = tmp_path / "run"
    # hvdtrain launch: horovodrun whose exit code is the ranks' (plain horovodrun says 1 for any).
    # One loader worker per rank: the failed files' records come back from it with the batches.
    stopped = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2",
                              "--gloo", str(BIN / "python"), str(driver), *args, "data.workers=1",
                              f"output.dir={run_dir}"], cwd=tmp_path, env={**job_env(tmp_path), **vanish_env(folder)},
                             capture_output=True, text=True, timeout=600)
    output = stopped.stdout + stopped.stderr
    assert stopped.returncode == 65, output[-4000:]
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if "training data vanished" in line]
    assert len(lines) == 2, output[-4000:]   # rank 0's line, and hvdtrain launch's last line, which repeats it
    line = lines[0]
    assert lines[1] == [entry for entry in stopped.stderr.splitlines() if entry.strip()][-1]
    assert lines[1].startswith("hvdtrain launch: exit 65 (data files vanished") and lines[1].endswith(
        line[line.index("hvdtrain: training data vanished"):])
    found = re.search(r"hvdtrain: training data vanished: (\d+) of the (\d+) training files read in epoch 1 failed "
                      r"\(([\d.]+)%: (\d+) missing; data\.max_bad_fraction=0\.01 allows 1 of the epoch's 192\); "
                      rf"most in {re.escape(str(folder))}/ \((\d+)\); first missing: "
                      rf"{re.escape(str(folder))}/\S+\.JPEG\. "
                      r"Stopped before global step (\d+) \(epoch 1, step (\d+)/12\)", line)
    assert found, line
    failed, read, share, missing, in_folder, next_step, next_in_epoch = (
        float(v) if "." in v else int(v) for v in found.groups())
    assert failed == missing == in_folder >= 2 and read % GLOBAL_BATCH == 0
    assert abs(share - 100 * failed / read) <= 0.05
    stop_step = next_step - 1
    # The 4th batch was taken a step ahead before the deletion: the 5th is the first that can miss files.
    assert next_in_epoch == next_step and DELETE_AT_STEP + 1 <= stop_step <= 11
    listed = [json.loads(entry) for entry in (run_dir / "bad_files.jsonl").read_text().splitlines()]
    assert len(listed) == failed == len({entry["path"] for entry in listed})
    assert all(entry["reason"] == "missing" and entry["epoch"] == 0 and entry["split"] == "train" and
               Path(entry["path"]).parent == folder for entry in listed)
    saved = checkpoint.load(run_dir / "checkpoints" / "last.pt")
    assert saved["step"] == stop_step and saved["epoch"] == 0   # the last good step, not the one after
    assert f"checkpoint of the last good step is {run_dir / 'checkpoints'}" in line
    warnings = [entry for entry in output.splitlines() if "warning: skipping missing image file" in entry]
    assert len(warnings) <= 2 * 3   # the first few per rank; the summary and the list have the rest

    shutil.rmtree(folder)
    shutil.copytree(backup, folder)  # the mount is back
    resumed = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "resumed"), *args, f"output.dir={run_dir}"],
                     tmp_path)
    assert f"at epoch 1, step {stop_step}/12 (global step {stop_step})" in resumed.stdout, resumed.stdout[-3000:]
    assert "bad files" not in resumed.stdout
    for expected, got in zip(final_states(tmp_path / "expected"), final_states(tmp_path / "resumed")):
        assert_bitwise_equal(expected, got)


def deleted_after(data: Path, folder: Path, epoch: int, first_position: int) -> int:
    """How many of the folder's files the epoch's global order draws at or after ``first_position``."""
    index = build_index(data, None)
    doomed = {i for i, path in enumerate(index.train.paths) if path.startswith(f"{folder.name}/")}
    sampler = ShardedSampler(len(index.train.paths), 1, 0, seed=0)
    sampler.set_epoch(epoch)
    return int(np.isin(sampler.global_order()[first_position:], sorted(doomed)).sum())


def test_without_a_limit_each_epoch_counts_distinct_files_per_reason(tmp_path):
    data, folder, driver, args = scenario(tmp_path)
    # Read before the deletion: epoch 1's first 3 batches (trained) and the 4th (taken a step ahead).
    expected_epoch1 = deleted_after(data, folder, 0, (DELETE_AT_STEP + 1) * GLOBAL_BATCH)
    assert 0 < expected_epoch1 < 48
    run_dir = tmp_path / "run"
    result = launch("horovodrun-gloo", 2, [str(driver), *args, "data.max_bad_fraction=1", f"output.dir={run_dir}"],
                    tmp_path, env=vanish_env(folder))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("split") == "train"]
    assert [r["bad_files"] for r in train] == [expected_epoch1, 48]
    assert [r["bad_files_missing"] for r in train] == [expected_epoch1, 48]
    assert [r["bad_files_undecodable"] + r["bad_files_unreadable"] for r in train] == [0, 0]
    assert [r["samples"] for r in train] == [192, 192]   # every batch kept its size
    said = [re.sub(r"^\[\d+\]<stdout>:", "", line) for line in result.stdout.splitlines()]   # horovodrun's tags
    epoch_lines = [line for line in said if line.startswith("epoch ")]
    assert f"bad files skipped: {expected_epoch1} train / 0 val" in epoch_lines[0]
    assert "bad files skipped: 48 train / 0 val" in epoch_lines[1]
    summaries = [line for line in said if line.startswith("hvdtrain: bad files in epoch")]
    assert len(summaries) == 2, result.stdout[-3000:]
    assert summaries[1].startswith(f"hvdtrain: bad files in epoch 2: train 48 of 192 (48 missing); most in {folder}/ "
                                   f"(48); first missing: {folder}/")
    assert summaries[1].endswith(f"the run so far: 48 distinct (48 missing), listed in {run_dir / 'bad_files.jsonl'}")
    listed = [json.loads(entry) for entry in (run_dir / "bad_files.jsonl").read_text().splitlines()]
    assert [sum(e["epoch"] == epoch for e in listed) for epoch in (0, 1)] == [expected_epoch1, 48]


def test_a_class_folder_missing_at_start_up_is_one_line(tmp_path):
    """Between two legs of a run: a class folder emptied (a mount point left bare) stops the index
    scan; one gone entirely would shift every later label, so the resume refuses it."""
    data, folder, _, args = scenario(tmp_path)
    run_dir = tmp_path / "run"
    single = ["-m", "hvdtrain", *args, "train.steps_per_epoch=2", "train.epochs=1", f"output.dir={run_dir}"]
    gone_single = single[:-2] + ["train.epochs=2", f"output.dir={run_dir}"]
    launch("single", 1, single, tmp_path)
    shutil.move(folder, tmp_path / "aside")
    folder.mkdir()
    emptied = launch("single", 1, gone_single, tmp_path, check=False)
    assert emptied.returncode == 2 and "Traceback" not in emptied.stderr
    assert [line for line in emptied.stderr.splitlines() if line.strip()] == [
        f"hvdtrain: error: class folder {folder} has no image files (.jpg, .jpeg, .png, .ppm, .bmp, .pgm, .tif, "
        f".tiff, .webp); add images or remove the folder"]
    folder.rmdir()
    # gone from both splits (with it in val/ alone, the layout check says so)
    shutil.rmtree(data / "val" / folder.name)
    gone = launch("single", 1, gone_single, tmp_path, check=False)   # the classifier would have 3 outputs
    assert gone.returncode == 2 and "Traceback" not in gone.stderr
    assert [line for line in gone.stderr.splitlines() if line.strip()] == [
        f"hvdtrain: error: class folder(s) {folder.name} of checkpoint {run_dir / 'checkpoints' / 'last.pt'} are "
        f"missing from {data}/train (1 of its 4 classes: deleted, or a volume not mounted?); the labels after them "
        f"would shift. Restore them, or start a new run in another output.dir"]
