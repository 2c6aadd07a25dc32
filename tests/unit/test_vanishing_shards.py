"""Data that vanishes mid-run, in-process: a tar shard gone under the training stream leaves a
hole that the loader counts one step ahead, before the trainer takes anything of it, and only the
batches taken in its position; a validation shard gone (or cut short) drops and counts its
records; a validation pass past data.max_bad_fraction stops with exit code 65 after a checkpoint
of the epoch's training, and nothing of it is recorded below the stop."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hvdtrain import outcome
from hvdtrain.config import DataConfig
from hvdtrain.data.demo import generate
from hvdtrain.data.files import bad_files
from hvdtrain.data.files.bad_files import BadFile, EpochTally, Summary, over_limit, summarize
from hvdtrain.data.files.index import DataError
from hvdtrain.data.image.transforms import fast_eval_transform, fast_train_transform
from hvdtrain.data.shards import loader as shards
from hvdtrain.data.shards.manifest import join, read_manifest
from hvdtrain.data.shards.order import epoch_sequence
from hvdtrain.train import bad_data
from hvdtrain.train.engine import Epoch

BATCH = 4


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    """4 classes x 8 training images (32 records, about 4 a shard) and 4 x 3 validation images."""
    from hvdtrain.tools.prepare import prepare

    source = tmp_path_factory.mktemp("vanishing_source")
    generate(source, train_per_class=8, val_per_class=3, size=24, num_classes=4)
    dst = tmp_path_factory.mktemp("vanishing_shards") / "shards"
    prepare(source, dst, shard_size_mb=0.01, progress=False)
    return dst


@pytest.fixture
def shards_copy(shard_dir, tmp_path) -> Path:
    """A copy of the shards that a test may delete from."""
    import shutil

    return Path(shutil.copytree(shard_dir, tmp_path / "shards"))


def train_loader(root: Path, look_ahead: int) -> shards.ShardLoader:
    manifest = read_manifest(str(root))
    transform = fast_train_transform(DataConfig(image_size=16, val_resize=18))
    # One rank, no loader workers, no shuffle buffer: the batches are the epoch's shard order, cut in 4s.
    stream = shards.ShardStream(manifest, "train", 0, 1, 0, BATCH, transform, 0, 0, True)
    loader = shards.ShardLoader(torch.utils.data.DataLoader(stream, batch_size=None), stream, fail=False)
    loader.hold_ahead(look_ahead, None)
    stream.set_epoch(0)
    return loader


def val_loader(root: Path) -> shards.ShardLoader:
    manifest = read_manifest(str(root))
    transform = fast_eval_transform(DataConfig(image_size=16, val_resize=18))
    stream = shards.ShardStream(manifest, "val", 0, 1, 0, BATCH, transform, 0, 0, False)
    return shards.ShardLoader(torch.utils.data.DataLoader(stream, batch_size=None), stream, fail=False)


def doomed_shard(root: Path) -> tuple[str, int]:
    """A training shard whose first record comes at batch 2 or later of epoch 0, and that batch."""
    split = read_manifest(str(root)).train
    order = epoch_sequence(split, 0, 0)
    shard_of = np.searchsorted(split.offsets, order, side="right") - 1
    for position in range(2 * BATCH, len(order)):
        if shard_of[position] != shard_of[position - 1]:
            return join(str(root), split.names[shard_of[position]]), position // BATCH
    raise AssertionError("no shard starts after batch 2: make the shards smaller")


def test_a_vanished_training_shard_is_counted_a_step_ahead_and_the_position_counts_only_batches_taken(shards_copy):
    path, hole_at = doomed_shard(shards_copy)
    loader = train_loader(shards_copy, look_ahead=1)
    Path(path).unlink()   # the volume goes: nothing of the shard was opened yet
    batches = iter(loader)
    assert loader.tally.files_read == BATCH and loader.stream.batches_taken == 0   # batch 0, read ahead
    for taken in range(hole_at):
        assert loader.tally.row_end is None   # not counted before the step ahead of it
        images, labels = next(batches)
        assert images.shape[0] == BATCH and loader.stream.batches_taken == taken + 1
    # The batch the next step would take is the hole: counted now, before any rank takes it.
    hole = loader.tally.row_end
    assert hole is not None and (hole.path, hole.reason, hole.shard, hole.own) == (path, "missing", True, True)
    assert hole.detail == "FileNotFoundError: No such file or directory"
    assert over_limit(loader.tally.vector().tolist(), max_fraction=1.0, epoch_files=32)   # whatever the share
    assert loader.tally.counts() == [1, 0, 0] and loader.tally.files_read == hole_at * BATCH
    # A checkpoint now records the batches trained on, not the ones held ahead.
    assert loader.stream.state_dict()["total"] == hole_at * BATCH
    with pytest.raises(DataError, match=rf"^training shard {path} cannot be read \(FileNotFoundError: No such "
                                        r"file or directory\): restore the shards"):
        next(batches)   # asked for anyway (no guard): one line, not a traceback from the reader
    assert loader.stream.batches_taken == hole_at


def test_the_stream_sends_a_picklable_hole_in_place_of_the_batch_and_nothing_after_it(shards_copy):
    path, hole_at = doomed_shard(shards_copy)
    stream = train_loader(shards_copy, look_ahead=0).stream
    Path(path).unlink()
    produced = list(stream)   # what a worker sends, in order
    assert len(produced) == hole_at + 1 and all(len(labels) == BATCH for _, labels, _ in produced[:-1])
    images, labels, (record,) = produced[-1]
    assert len(images) == len(labels) == 0
    back = pickle.loads(pickle.dumps(record))
    assert (back.path, back.reason, back.row_end, back.shard) == (path, "missing", True, True)
    assert not BadFile("x", "missing", "y").shard


def test_without_a_vanished_shard_look_ahead_changes_nothing_but_when_batches_are_read(shard_dir):
    plain, ahead = train_loader(shard_dir, look_ahead=0), train_loader(shard_dir, look_ahead=2)
    iterator = iter(ahead)
    assert ahead.tally.files_read == 2 * BATCH and ahead.stream.batches_taken == 0
    got = [(images, labels) for images, labels in iter(plain)]
    assert len(got) == len(plain) == 8
    for images, labels in got:
        other_images, other_labels = next(iterator)
        assert torch.equal(images, other_images) and torch.equal(labels, other_labels)
    with pytest.raises(StopIteration):
        next(iterator)
    assert ahead.stream.batches_taken == plain.stream.batches_taken == 8 and ahead.tally.files_read == 32
    # An epoch of fewer steps than the stream has batches (train.steps_per_epoch): nothing read beyond them.
    short = train_loader(shard_dir, look_ahead=2)
    short.hold_ahead(2, 3)
    assert len([next(iterator) for iterator in [iter(short)] for _ in range(3)]) == 3
    assert short.tally.files_read == 3 * BATCH and short.stream.batches_taken == 3


def test_a_pass_with_no_batch_left_reads_nothing(shard_dir):
    loader = train_loader(shard_dir, look_ahead=1)
    loader.stream.set_epoch(0, start=32)   # resumed at the epoch's end (validation came next)
    before = torch.get_rng_state()
    assert len(loader) == 0 and list(iter(loader)) == [] and loader.tally.files_read == 0
    # Not even the DataLoader's iterator is made: it would draw its seed from the global generator,
    # which the uninterrupted run did not draw there (it made that epoch's iterator before its checkpoint).
    assert torch.equal(before, torch.get_rng_state())


def test_the_engine_has_the_shard_loader_hold_one_step_of_batches():
    from tests.unit.test_engine import batches, make

    class Held:   # what the engine reads of a ShardLoader
        counts_bad_files = counts_taken_batches = True
        held = None

        def hold_ahead(self, ahead, count):
            self.held = (ahead, count)

        def __iter__(self):
            assert self.held is not None   # told before the pass starts
            return iter(batches(4))

    loader = Held()
    state, settings = make(passes=2)
    Epoch(state, settings, loader, 3, lambda tensor: tensor)
    assert loader.held == (2, 6)   # one step's 2 batches ahead, 3 steps' batches in all


def test_a_vanished_validation_shard_drops_and_counts_its_records(shards_copy):
    manifest = read_manifest(str(shards_copy))
    first = manifest.val.names[0]
    count = int(manifest.val.counts[0])
    loader = val_loader(shards_copy)
    (shards_copy / first).unlink()
    evaluated = sum(len(labels) for _, labels in loader)
    tally = loader.pop_epoch()
    assert evaluated == 12 - count and tally.files_read == 12 and tally.counts() == [count, 0, 0]
    names = list(tally.own)
    assert names == [f"{shards_copy}/{first}:#{i}" for i in range(count)]
    assert tally.own[names[0]].detail == "FileNotFoundError: No such file or directory"


def test_a_validation_shard_cut_short_counts_its_records_as_undecodable(shards_copy):
    manifest = read_manifest(str(shards_copy))
    loader = val_loader(shards_copy)
    (shards_copy / manifest.val.names[-1]).write_bytes(b"")   # a copy cut short
    evaluated = sum(len(labels) for _, labels in loader)
    tally = loader.pop_epoch()
    count = int(manifest.val.counts[-1])
    assert evaluated == 12 - count and tally.counts() == [0, 0, count]
    assert next(iter(tally.own.values())).detail == (f"fewer records than the {count} that manifest.json lists: "
                                                      f"changed since it was written?")


def missing(count: int, folder: str = "/d/val/c1") -> Summary:
    return summarize([(60, [BadFile(f"{folder}/{i}.JPEG", "missing", "FileNotFoundError: No such file") for i in
                            range(count)], None)])


def test_the_validation_limit_is_a_share_of_the_split():
    validation_over_limit = bad_files.validation_over_limit
    assert not validation_over_limit(None, 0.01, 60) and not validation_over_limit(Summary(), 0.0, 60)
    assert not validation_over_limit(missing(6), 0.1, 60) and validation_over_limit(missing(7), 0.1, 60)
    assert validation_over_limit(missing(1), 0.01, 60)         # 1% of 60 allows none
    assert not validation_over_limit(missing(60), 1.0, 60)     # 1 never stops on a share
    assert validation_over_limit(missing(7), 0.1, 0)           # no split size: the samples read (60)


def one_rank(monkeypatch) -> None:
    """The collectives of one rank without Horovod: a broadcast returns what it sends."""
    monkeypatch.setattr(bad_data.dist, "broadcast_object", lambda obj, root_rank=0, name=None: obj)


class Loader:
    def __init__(self, summary: Summary | None, fail: bool = False):
        self.last_summary, self.fail, self.tally = summary, fail, EpochTally()


def fake_run(tmp_path: Path, val: Summary | None, max_fraction: float = 0.01, fail: bool = False):
    return SimpleNamespace(loaders=SimpleNamespace(train=Loader(None), val=Loader(val, fail), val_size=60),
                           cfg=SimpleNamespace(data=SimpleNamespace(max_bad_fraction=max_fraction),
                                               output=SimpleNamespace(share="private")),
                           run_dir=tmp_path / "run")


def test_validation_past_the_limit_checkpoints_the_training_lists_the_files_and_stops_with_65(tmp_path, monkeypatch,
                                                                                             capsys):
    saved = []
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000024.pt"
    monkeypatch.setattr(bad_data, "save_checkpoint", lambda run, saver, **kw: saved.append(kw) or checkpoint)
    one_rank(monkeypatch)
    run = fake_run(tmp_path, missing(9))
    with pytest.raises(bad_data.DataVanished) as stop:
        bad_data.check_validation(run, SimpleNamespace(saver=None), epoch=1)
    assert saved == [{"audited": True, "must": True}]
    assert stop.value.exit_code == outcome.EXIT_DATA_VANISHED == 65 and stop.value.after_checkpoint
    line = capsys.readouterr().err.strip()
    assert line == (f"hvdtrain: validation data vanished: 9 of the 60 validation samples failed in epoch 2 (15.0%: "
                    f"9 missing; data.max_bad_fraction=0.01 allows 0); most in /d/val/c1/ (9); first missing: "
                    f"/d/val/c1/0.JPEG. Epoch 2's training is saved, not validated (its metrics would leave those "
                    f"samples out), in {checkpoint}; the failed files are listed in "
                    f"{tmp_path / 'run' / 'bad_files.jsonl'}. Restore the data (remount the volume), then run the "
                    f"same command: it resumes there and validates epoch 2 again; or raise data.max_bad_fraction")
    assert str(stop.value) == line and outcome.cause() == line
    listed = [json.loads(entry) for entry in (tmp_path / "run" / "bad_files.jsonl").read_text().splitlines()]
    assert [(e["epoch"], e["split"], e["reason"]) for e in listed] == [(1, "val", "missing")] * 9
    assert run.loaders.val.last_summary is None   # taken: nothing of this validation is recorded after it


def test_validation_below_the_limit_or_failing_at_once_goes_on(tmp_path, monkeypatch):
    monkeypatch.setattr(bad_data, "save_checkpoint", lambda *a, **kw: pytest.fail("checkpointed for nothing"))
    below = fake_run(tmp_path, missing(9), max_fraction=0.15)
    bad_data.check_validation(below, SimpleNamespace(saver=None), epoch=0)
    assert below.loaders.val.last_summary.total == 9   # left for note_epoch's line and the val record
    bad_data.check_validation(fake_run(tmp_path, missing(9), fail=True), SimpleNamespace(saver=None), epoch=0)
    bad_data.check_validation(fake_run(tmp_path, None), SimpleNamespace(saver=None), epoch=0)   # no counting loader
    assert not (tmp_path / "run" / "bad_files.jsonl").exists()


def test_a_vanished_shard_stops_training_with_a_line_that_names_it(tmp_path, monkeypatch, capsys):
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000008.pt"
    monkeypatch.setattr(bad_data, "save_checkpoint", lambda run, saver, **kw: checkpoint)
    one_rank(monkeypatch)
    shard = BadFile("/d/shards/train-000004.tar", "missing", "FileNotFoundError: No such file or directory",
                    row_end=True, shard=True)
    summary = summarize([(64, [BadFile("/d/shards/train-000001.tar:k9", "undecodable", "bad")], None),
                         (64, [shard], shard)])
    train = Loader(summary)
    run = SimpleNamespace(loaders=SimpleNamespace(train=train), run_dir=tmp_path / "run",
                          state=SimpleNamespace(position=SimpleNamespace(epoch=0, step=8, step_in_epoch=8)))
    guard = bad_data.DataGuard(train, max_fraction=0.5)
    guard.start_epoch(192)
    with pytest.raises(bad_data.DataVanished):
        bad_data.stop_for_vanished_data(run, SimpleNamespace(saver=None), guard, bad_data.BadFilesLog(tmp_path / "run"),
                                        steps=12)
    line = capsys.readouterr().err.strip()
    assert line == (f"hvdtrain: training data vanished: shard /d/shards/train-000004.tar cannot be read (missing: "
                    f"FileNotFoundError: No such file or directory), and epoch 1 needs it. Stopped before global "
                    f"step 9 (epoch 1, step 9/12): the checkpoint of the last good step is {checkpoint}, the failed "
                    f"files are listed in {tmp_path / 'run' / 'bad_files.jsonl'}. Restore the shards (remount the "
                    f"volume), then run the same command to resume")
    listed = [json.loads(entry) for entry in (tmp_path / "run" / "bad_files.jsonl").read_text().splitlines()]
    assert {e["path"] for e in listed} == {"/d/shards/train-000004.tar", "/d/shards/train-000001.tar:k9"}
