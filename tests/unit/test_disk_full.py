"""A checkpoint that does not fit: one line naming the folder and the bytes, nothing partial left,
the older checkpoints intact; metrics.jsonl and tensorboard writes that fail cost their records,
not the run. (A real run on a small tmpfs: tests/parallel/test_disk_full.py.)"""

from __future__ import annotations

import errno
import json
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import io as checkpoint
from hvdtrain.observe.metrics import MetricsWriter

Usage = namedtuple("Usage", "total used free")


def payload(step: int, megabytes: int = 2) -> dict:
    return {"model": {"w": torch.zeros(megabytes * 2**18)}, "optimizer": {}, "epoch": 0, "step": step,
            "config": {}}


def test_a_checkpoint_that_will_not_fit_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    saver = checkpoint.CheckpointSaver(tmp_path / "checkpoints", keep=2)
    first = saver.save(payload(1), is_best=True)
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda path: Usage(100 * 2**20, 90 * 2**20, 20 * 2**20))
    with pytest.raises(checkpoint.DiskFull) as error:
        saver.save(payload(2), is_best=True)
    line = error.value.strerror
    assert "\n" not in line and str(tmp_path / "checkpoints") in line
    assert "has 20 MB free and the checkpoint needs 2 MB (with 32 MB to spare)" in line
    assert "checkpoint.keep=2" in line and "output.dir" in line
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before  # nothing new, nothing lost
    assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["step"] == 1 and first.exists()


def test_enospc_while_writing_leaves_no_partial_file(tmp_path, monkeypatch):
    saver = checkpoint.CheckpointSaver(tmp_path / "checkpoints", keep=0)
    saver.save(payload(1), is_best=False)

    def full(obj, handle):
        handle.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", full)
    with pytest.raises(checkpoint.DiskFull, match="checkpoint not written"):
        saver.save(payload(2), is_best=False)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["last.pt"]
    monkeypatch.undo()
    assert checkpoint.load(tmp_path / "checkpoints" / "last.pt")["step"] == 1


def test_pytorchs_unexpected_pos_on_a_full_disk_is_a_full_disk(tmp_path, monkeypatch):
    # What torch.save raises when its archive writer's write fails (measured on a full tmpfs).
    def archive_error(obj, handle):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    saver = checkpoint.CheckpointSaver(tmp_path / "checkpoints", keep=1)
    monkeypatch.setattr(checkpoint.torch, "save", archive_error)
    real = checkpoint.shutil.disk_usage
    calls = []

    def usage(path):  # room before writing; full once the write has failed
        calls.append(path)
        return real(path) if len(calls) == 1 else Usage(100 * 2**20, 100 * 2**20, 0)

    monkeypatch.setattr(checkpoint.shutil, "disk_usage", usage)
    with pytest.raises(checkpoint.DiskFull):
        saver.save(payload(1), is_best=False)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_another_write_error_is_not_called_a_full_disk(tmp_path, monkeypatch):
    def broken(obj, handle):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(checkpoint.torch, "save", broken)
    with pytest.raises(OSError) as error:
        checkpoint.CheckpointSaver(tmp_path / "checkpoints", keep=1).save(payload(1), is_best=False)
    assert not isinstance(error.value, checkpoint.DiskFull) and error.value.errno == errno.EIO


def test_metrics_that_cannot_be_written_cost_records_not_the_run(tmp_path, capsys, monkeypatch):
    from hvdtrain.observe import metrics

    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write({"split": "train", "epoch": 0, "step": 1, "loss": 1.0})
    real_open = metrics.open_append

    def full(path, *args, **kwargs):
        if Path(path).name == "metrics.jsonl":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(metrics, "open_append", full)
    for step in (2, 3):
        writer.write({"split": "train", "epoch": 0, "step": step, "loss": 1.0})
    monkeypatch.undo()
    writer.write({"split": "train", "epoch": 0, "step": 4, "loss": 1.0})
    writer.close()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "writing metrics.jsonl" in err[0] and "No space left on device" in err[0]
    assert err[1] == f"hvdtrain: warning: 2 record(s) could not be written to metrics.jsonl in {tmp_path}"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 4]


def test_the_writers_full_disk_and_the_jobs_stop_are_two_classes_and_the_stop_exits_74():
    # checkpoint.DiskFull: the writer's error (an OSError, ENOSPC), which training survives unless the
    # checkpoint had to be written; save.DiskFullStop: the job's stop then, on every rank, exit 74.
    from hvdtrain import outcome
    from hvdtrain.train.guard import JobStopped
    from hvdtrain.train.save import DiskFullStop

    assert issubclass(checkpoint.DiskFull, OSError) and not issubclass(checkpoint.DiskFull, JobStopped)
    assert issubclass(DiskFullStop, JobStopped) and not issubclass(DiskFullStop, OSError)
    assert DiskFullStop.__name__ != checkpoint.DiskFull.__name__
    assert outcome.stop_code(DiskFullStop("hvdtrain: no space", speak=True)) == outcome.EXIT_DISK_FULL == 74


def test_the_epochs_records_are_written_with_its_checkpoint_before_the_ranks_compare(tmp_path, monkeypatch):
    """A link lost in the round after rank 0's write used to lose the epoch's metrics records: the
    resume starts after that epoch, so nothing wrote them again (the pulled-link test,
    tests/multinode/test_netns.py). Rank 0 now writes them before that round."""
    import contextlib
    from types import SimpleNamespace

    from hvdtrain.train import save
    from hvdtrain.train.stops import LostRank

    saver = checkpoint.CheckpointSaver(tmp_path / "checkpoints", keep=2)
    run = SimpleNamespace(settings=SimpleNamespace(guard=None),
                          watchdog=SimpleNamespace(busy=contextlib.nullcontext))
    monkeypatch.setattr(save, "checkpoint_payload", lambda run: payload(2, megabytes=1))
    events = []

    def lost(tensor, name):
        events.append("round")
        raise LostRank("lost rank 1 (node1, pid 7)", speak=True)

    monkeypatch.setattr(save.dist, "broadcast", lost)
    with pytest.raises(LostRank):
        save.save_checkpoint(run, saver, audited=True, on_saved=lambda path: events.append(path))
    assert events == [tmp_path / "checkpoints" / "step-00000002.pt", "round"]
