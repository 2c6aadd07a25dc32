"""A run whose output folder fills up, on a real small tmpfs (the tests run as root): a checkpoint
that does not fit is one warning and training goes on; the final one that does not fit ends the
job with exit code 74 and one line; the last good checkpoint stays loadable and nothing partial
is left. Also the write itself running out of space (PyTorch's "unexpected pos"), not only the
check before it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import io as checkpoint
from tests.helpers import BIN, job_env, tiny


@pytest.fixture
def small_disk(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "disk"
    mount.mkdir()

    def make(megabytes: int) -> Path:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(mount)], check=True)
        return mount

    yield make
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_output_folder_warns_then_stops_with_74_and_keeps_the_last_good_checkpoint(small_disk, tiny_data,
                                                                                             tmp_path):
    # resnet18's checkpoints are 89.5 MB: on 160 MB the first fits, the second does not.
    disk = small_disk(160)
    run_dir = disk / "run"
    result = subprocess.run([str(BIN / "python"), "-m", "hvdtrain",
                             *tiny(tiny_data, run_dir, "train.epochs=3", "checkpoint.keep=1")],
                            cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 74, output[-3000:]
    assert "Traceback" not in output
    assert [line for line in output.splitlines() if line.startswith("epoch ")][-1].startswith("epoch 3/3 ")
    warnings = [line for line in output.splitlines() if "checkpoint not written" in line]
    assert len(warnings) == 2, output[-3000:]  # epoch 2's (training went on), then the final one's
    assert "training goes on and the next checkpoint tries again" in warnings[0]
    assert result.stderr.strip().splitlines()[-1] == warnings[1]
    assert f"{run_dir / 'checkpoints'} has " in warnings[1] and "MB free and the checkpoint needs 85 MB" in warnings[1]
    names = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert names == ["best.pt", "last.pt", "step-00000004.pt"]  # epoch 1's, and no temporary file
    assert checkpoint.load(run_dir / "checkpoints" / "last.pt")["epoch"] == 1
    records = [line for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 6  # metrics.jsonl kept every epoch: the checkpoints left it room


def test_the_write_itself_running_out_of_space_is_a_full_disk_and_leaves_nothing(small_disk, monkeypatch):
    disk = small_disk(4)
    monkeypatch.setattr(checkpoint, "MARGIN_BYTES", 0)
    saver = checkpoint.CheckpointSaver(disk / "checkpoints", keep=1)
    saver.save({"model": {"w": torch.zeros(2**18)}, "optimizer": {}, "epoch": 0, "step": 1, "config": {}},
               is_best=False)  # 1 MB
    monkeypatch.setattr(checkpoint, "payload_bytes", lambda payload: 0)  # the check before writing passes
    with pytest.raises(checkpoint.DiskFull, match="checkpoint not written"):
        saver.save({"model": {"w": torch.zeros(2**20)}, "optimizer": {}, "epoch": 0, "step": 2, "config": {}},
                   is_best=False)  # 4 MB
    assert sorted(p.name for p in (disk / "checkpoints").iterdir()) == ["last.pt", "step-00000001.pt"]
    assert checkpoint.load(disk / "checkpoints" / "last.pt")["step"] == 1
