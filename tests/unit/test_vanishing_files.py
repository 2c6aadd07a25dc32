"""Files that vanish, cannot be read or cannot be decoded: distinct files counted per reason (not
replacement attempts), combined exactly over ranks, the limit that stops a run, the list written as
data, and the engine taking a step's batches ahead so that a stop comes before the step."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from hvdtrain.config import ConfigError, DataConfig
from hvdtrain.data.demo import generate
from hvdtrain.data.files.bad_files import (
    BadFile,
    EpochTally,
    allowed_failures,
    as_bad_file,
    combine,
    fields,
    over_limit,
    summarize,
    vanished_classes,
)
from hvdtrain.data.files.index import DataError, build_index
from hvdtrain.data.image.folder import MAX_REPLACEMENTS, CountingLoader, ImageFiles, collate
from hvdtrain.data.image.transforms import fast_train_transform
from hvdtrain.data.shards.manifest import FORMAT, read_manifest
from hvdtrain.job_config import load_config
from hvdtrain.train.bad_data import BadFilesLog, DataGuard
from hvdtrain.train.engine import DeviceBatches


def dataset(root: Path, per_class: int = 48, classes: int = 4) -> tuple[ImageFiles, list[str]]:
    generate(root, train_per_class=per_class, val_per_class=1, size=24, num_classes=classes)
    index = build_index(root, None)
    transform = fast_train_transform(DataConfig(image_size=16, val_resize=18))
    return ImageFiles(root / "train", index.train.paths, index.train.labels, transform, replace_bad=True), \
        list(index.train.classes)


def loader_over(files: ImageFiles, batch: int = 16) -> CountingLoader:
    return CountingLoader(torch.utils.data.DataLoader(files, batch_size=batch, collate_fn=collate), fail=False)


def test_a_vanished_class_folder_counts_its_files_once_not_each_replacement_attempt(tmp_path, capsys):
    files, classes = dataset(tmp_path / "data")
    gone = tmp_path / "data" / "train" / classes[1]
    for path in gone.iterdir():
        path.unlink()   # the scenario: 48 of 192 training files
    loader = loader_over(files)
    attempts = 0
    for images, labels in loader:
        assert images.shape[0] == 16   # every batch keeps its size: replaced by the next class's files
    tally = loader.pop_epoch()
    assert tally.counts() == [48, 0, 0] and tally.files_read == 192 and tally.row_end is None
    assert set(tally.own) == {f"{gone.parent}/{name}" for name in files.paths if name.startswith(f"{classes[1]}/")}
    # What the epoch line used to count: every failed read, replacements included (1 + 2 + ... + 48).
    for index in range(len(files)):
        attempts += len(files[index][2])
    assert attempts == 48 * 49 // 2
    assert loader.pop_bad_files() == 0   # the next pass starts from zero
    err = capsys.readouterr().err
    assert err.count("hvdtrain: warning: skipping missing image file") == 3   # the first few, then one note
    assert err.count("further bad files are counted in each epoch's line") == 1


def test_reasons_missing_unreadable_undecodable(tmp_path):
    files, classes = dataset(tmp_path / "data", per_class=4, classes=2)
    first, second, third = (tmp_path / "data" / "train" / p for p in files.paths[:3])
    first.unlink()
    second.unlink()
    second.mkdir()                          # a path that exists but cannot be read as a file (EISDIR)
    third.write_bytes(b"not an image")
    records = files[0][2]
    assert [(r.path, r.reason, r.own) for r in records] == [
        (str(first), "missing", True), (str(second), "unreadable", False), (str(third), "undecodable", False)]
    assert records[0].detail.startswith("FileNotFoundError") and records[1].detail.startswith("IsADirectoryError")
    assert str(records[0]) == f"{first} ({records[0].detail})"   # the text warnings and old records use


def test_a_record_survives_the_trip_from_a_loader_worker(tmp_path):
    record = BadFile("/d/train/a\tb\n.JPEG", "missing", "FileNotFoundError: No such file", own=False, row_end=True)
    back = pickle.loads(pickle.dumps(record))
    assert (back.path, back.reason, back.detail, back.own, back.row_end) == (record.path, "missing",
                                                                               record.detail, False, True)
    assert str(back) == str(record)
    old = as_bad_file("s3://b/train-0001.tar:key7 (no image member)")   # the shard loader's text records
    assert (old.path, old.reason, old.detail, old.own) == ("s3://b/train-0001.tar:key7", "undecodable",
                                                           "no image member", True)


def test_sixty_four_in_a_row_leave_the_sample_without_an_image_and_say_so(tmp_path):
    files, classes = dataset(tmp_path / "data", per_class=40, classes=2)
    shutil.rmtree(tmp_path / "data" / "train")   # the whole mount: every file missing
    image, _, records = files[5]
    assert image is None and len(records) == MAX_REPLACEMENTS
    assert records[-1].row_end and not any(r.row_end for r in records[:-1]) and records[0].own
    tally = EpochTally()
    tally.note(records, samples=1)
    assert tally.row_end is records[-1] and tally.counts() == [1, 0, 0]
    assert over_limit(tally.vector().tolist(), max_fraction=1.0, epoch_files=80)   # stops even at 100%


def test_the_limit_is_a_share_of_the_epoch_rounded_down():
    assert allowed_failures(0.01, 192) == 1 and allowed_failures(0.01, 1_281_167) == 12811
    assert allowed_failures(0.0, 192) == 0 and allowed_failures(1.0, 192) == 192
    assert not over_limit([1, 0, 0, 0, 64], 0.01, 192)
    assert over_limit([1, 1, 0, 0, 64], 0.01, 192) and over_limit([0, 0, 2, 0, 64], 0.01, 192)
    assert over_limit([1, 0, 0, 0, 16], 0.0, 192) and not over_limit([0, 0, 0, 0, 16], 0.0, 192)
    with pytest.raises(ConfigError, match=r"^config key 'data.max_bad_fraction' is a share .*got 1.5$"):
        load_config("debug", ["data.max_bad_fraction=1.5"])
    assert load_config("debug", []).data.max_bad_fraction == 0.01


def test_ranks_combine_exactly_a_file_two_ranks_met_counts_once():
    """Two ranks' tallies through the collectives' arithmetic (a sum, a gather): the sum decides
    whether to gather, the gathered records give the union."""
    missing = [BadFile(f"/d/train/c1/{i}.JPEG", "missing", "FileNotFoundError") for i in range(3)]
    broken = BadFile("/d/train/c2/x.JPEG", "undecodable", "empty file")
    ranks = [EpochTally(), EpochTally()]
    ranks[0].note([missing[0], missing[1], BadFile(missing[2].path, "missing", "x", own=False)], samples=16)
    ranks[1].note([missing[2], broken, missing[1]], samples=16)   # missing[1] again: the padded last batch
    sums = lambda tensor: ranks[0].vector() + ranks[1].vector()   # noqa: E731 - what allreduce_sum returns
    # What each rank sends through the gather: plain fields, as they travel between ranks (comm/wire.py).
    gathered = [(t.files_read, [fields(record) for record in t.own.values()],
                 None if t.row_end is None else fields(t.row_end)) for t in ranks]
    summary = combine(ranks[0], sums, lambda mine: gathered)
    assert summary.by_reason == {"missing": 3, "unreadable": 0, "undecodable": 1} and summary.total == 4
    assert summary.files_read == 32 and summary.folder_most_affected() == ("/d/train/c1", 3)
    assert summary.first("missing").path == "/d/train/c1/0.JPEG"
    assert summary.metrics() == {"bad_files": 4, "bad_files_missing": 3, "bad_files_unreadable": 0,
                                 "bad_files_undecodable": 1}
    clean = combine(EpochTally(files_read=16), lambda t: t * 2, lambda mine: pytest.fail("gathered for nothing"))
    assert clean.metrics() == {"bad_files": 0} and clean.files_read == 32
    assert summarize([]).total == 0


def test_the_guard_decides_from_the_sums_every_rank_gets():
    class Loader:
        tally, fail = EpochTally(), False

    guard = DataGuard(Loader(), max_fraction=0.01)
    guard.start_epoch(192)
    assert not guard.check(torch.tensor([1.0, 0, 0, 0, 48]))
    assert guard.check(torch.tensor([1.0, 1, 0, 0, 64])) and guard.tripped
    assert guard.check(torch.tensor([0.0, 0, 0, 0, 80]))   # stays tripped until the next epoch
    guard.start_epoch(192)
    assert not guard.tripped and not guard.check(None)


def test_the_list_is_json_data_and_a_resumed_run_reads_its_totals_back(tmp_path):
    odd = BadFile('/d/train/c1/x"\t\n$(touch pwned).JPEG', "missing", "FileNotFoundError: No such file")
    summary = summarize([(16, [odd, BadFile("/d/train/c1/y.JPEG", "unreadable", "OSError: EIO")], None)])
    log = BadFilesLog(tmp_path / "run")
    log.write(0, "train", summary)
    log.write(1, "train", summarize([(16, [odd], None)]))
    lines = (tmp_path / "run" / "bad_files.jsonl").read_text().splitlines()
    assert len(lines) == 3 and json.loads(lines[0]) == {"epoch": 0, "split": "train", "reason": "missing",
                                                        "path": odd.path, "error": odd.detail}
    assert not (tmp_path / "pwned").exists()
    with open(tmp_path / "run" / "bad_files.jsonl", "a") as handle:
        handle.write('{"epoch": 2, "split": "train", "reason": "missing", "pa')   # a write cut short
    again = BadFilesLog(tmp_path / "run")
    assert again.run_totals() == "2 distinct (1 missing, 1 unreadable)"


def test_the_engine_counts_a_step_s_batches_before_the_step_takes_them(tmp_path):
    files, classes = dataset(tmp_path / "data", per_class=8, classes=2)
    for path in (tmp_path / "data" / "train" / classes[0]).iterdir():
        path.unlink()

    class Settings:   # what DeviceBatches asks of StepSettings, on a CPU
        device, dtype, prefetch = torch.device("cpu"), torch.float32, True

        class task:
            @staticmethod
            def to_device(batch, device, dtype):
                return batch

    loader = loader_over(files, batch=4)
    batches = DeviceBatches(loader, Settings(), count=4, ahead=1)
    # Nothing asked for yet, and the first batch's 4 missing files are counted already.
    assert loader.tally.counts() == [4, 0, 0] and loader.tally.files_read == 4
    next(batches)
    assert loader.tally.files_read == 8
    assert len(list(batches)) == 3 and loader.tally.files_read == 16   # never beyond ``count``
    plain = loader_over(files, batch=4)
    DeviceBatches(plain, Settings(), count=4)
    assert plain.tally.files_read == 0


def test_a_class_folder_gone_since_the_checkpoint_refuses_the_resume_in_one_line():
    saved = {"name": "image_classification", "num_classes": 4, "classes": ["a", "b", "c", "d"]}
    gone = vanished_classes(saved, {"classes": ["a", "c", "d"]}, "runs/x/checkpoints/last.pt", "/data/train")
    assert gone == ("class folder(s) b of checkpoint runs/x/checkpoints/last.pt are missing from /data/train (1 of "
                    "its 4 classes: deleted, or a volume not mounted?); the labels after them would shift. Restore "
                    "them, or start a new run in another output.dir")
    added = vanished_classes(saved, {"classes": ["a", "b", "b2", "c", "d"]}, "last.pt", "/data/train")
    assert added.startswith("/data/train has class folder(s) b2 that checkpoint last.pt was not trained with")
    assert vanished_classes(saved, {"classes": ["a", "b", "c", "d"]}, "last.pt", "/d") is None
    assert vanished_classes({"num_classes": 4}, {"classes": ["a"]}, "old.pt", "/d") is None   # an older checkpoint


def test_shards_missing_at_start_up_are_named_in_one_line(tmp_path):
    shards = {"train": ["train-000000.tar", "train-000001.tar"], "val": ["val-000000.tar"]}
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": FORMAT, "classes": ["a", "b"],
        "splits": {split: {"shards": [{"name": name, "images": 4} for name in names]}
                   for split, names in shards.items()}}))
    for name in ("train-000000.tar", "val-000000.tar"):
        (tmp_path / name).write_bytes(bytes(4096))  # room for the 4 records the manifest counts
    with pytest.raises(DataError) as info:
        read_manifest(str(tmp_path))
    assert str(info.value) == (f"1 of the 3 shards that {tmp_path}/manifest.json lists are missing, e.g. "
                               f"{tmp_path}/train-000001.tar: restore them (a volume not mounted?) or prepare the "
                               f"shards again")
    (tmp_path / "train-000001.tar").write_bytes(bytes(4096))
    assert read_manifest(str(tmp_path)).train.names == shards["train"]
