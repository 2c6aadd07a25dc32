"""prepare (tar shards, manifest, resume after SIGKILL, refusal) and the shard reader's arithmetic
(permutation, dealing to ranks and workers, equal steps, exact validation, resume), in-process."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hvdtrain.config import Config
from hvdtrain.data.demo import generate
from hvdtrain.data.files.index import DataError, scan_split
from hvdtrain.data.image.transforms import fast_eval_transform, fast_train_transform
from hvdtrain.data.shards import loader as shards
from hvdtrain.data.shards import manifest as shard_manifest
from hvdtrain.data.shards import order as shard_order
from hvdtrain.tools.prepare import PrepareError, prepare
from tests.helpers import REPO


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """10 classes: 13 training and 5 validation images each, 32 px."""
    root = tmp_path_factory.mktemp("shard_source")
    generate(root, train_per_class=13, val_per_class=5, size=32)
    return root


@pytest.fixture(scope="module")
def prepared(source, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("shards") / "out"
    prepare(source, dst, shard_size_mb=0.05, progress=False)
    return dst


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_webdataset_reads_the_shards_with_their_keys_and_labels(source, prepared):
    import webdataset as wds

    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["classes"] == scan_split(source / "train").classes
    assert manifest["splits"]["train"]["images"] == 130 and manifest["splits"]["val"]["images"] == 50
    assert len(manifest["splits"]["train"]["shards"]) > 3 and manifest["skipped"] == []
    for split in ("train", "val"):
        index = scan_split(source / split)
        urls = [str(prepared / shard["name"]) for shard in manifest["splits"][split]["shards"]]
        seen = {}
        for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            seen[sample["__key__"]] = (int(sample["cls"]), sample["jpg"])
        assert len(seen) == len(index.paths)
        for key, (label, data) in seen.items():
            position = int(key)
            assert label == index.labels[position]
            assert data == (source / split / index.paths[position]).read_bytes()  # copied untouched
        for shard in manifest["splits"][split]["shards"]:
            assert digest(prepared / shard["name"]) == shard["sha256"]
            with tarfile.open(prepared / shard["name"]) as tar:
                assert {m.mtime for m in tar} == {0} and {m.uid for m in tar} == {0}


def test_prepare_refuses_foreign_content_and_other_options(source, prepared, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(PrepareError, match="not empty and holds no hvdtrain prepare output"):
        prepare(source, foreign, progress=False)
    assert (foreign / "notes.txt").read_text() == "mine" and len(os.listdir(foreign)) == 1
    with pytest.raises(PrepareError, match="other options"):
        prepare(source, prepared, shard_size_mb=0.05, max_side=16, progress=False)
    # Its own complete output with the same options: nothing to do, nothing changed.
    before = {p.name: digest(p) for p in prepared.iterdir()}
    prepare(source, prepared, shard_size_mb=0.05, progress=False)
    assert {p.name: digest(p) for p in prepared.iterdir()} == before


def test_killed_prepare_leaves_no_partial_shard_and_resumes_to_identical_output(source, tmp_path):
    reference = tmp_path / "reference"
    prepare(source, reference, shard_size_mb=0.02, max_side=24, quality=80, progress=False)
    killed = tmp_path / "killed"
    command = [sys.executable, "-m", "hvdtrain", "prepare", str(source), str(killed), "--shard-size", "0.02",
               "--max-side", "24", "--quality", "80", "--no-progress"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    mid_shard = False
    for _ in range(5):  # kill while a shard is being written (a temporary file exists)
        job = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            while job.poll() is None and time.monotonic() < deadline:
                if list(killed.glob(".train-*.tmp-*")) and list(killed.glob("train-*.tar")):
                    os.kill(job.pid, signal.SIGKILL)
                    break
                time.sleep(0.001)
        finally:
            job.kill()
            job.wait()
        if list(killed.glob(".*.tmp-*")):
            mid_shard = True
            break
        if (killed / "manifest.json").exists():
            import shutil

            shutil.rmtree(killed)
    assert mid_shard, "never caught prepare in the middle of a shard"
    assert not (killed / "manifest.json").exists()
    expected = {p.name: digest(p) for p in reference.iterdir()}
    for final in killed.glob("*.tar"):  # under a final name only complete shards
        assert digest(final) == expected[final.name]
    resumed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming" in resumed.stderr
    expected = {**expected, "manifest.json": digest(killed / "manifest.json")}
    assert {p.name: digest(p) for p in killed.iterdir()} == expected
    ours = json.loads((killed / "manifest.json").read_text())
    theirs = json.loads((reference / "manifest.json").read_text())
    ours["options"]["source"] = theirs["options"]["source"]
    assert ours == theirs


# --- the reader ----------------------------------------------------------------------------------

def counts_split(counts: list[int]) -> shard_manifest.Split:
    counts_array = np.array(counts, dtype=np.int64)
    return shard_manifest.Split([f"s{i}" for i in range(len(counts))], counts_array,
                        np.concatenate([[0], np.cumsum(counts_array)]))


def stream_for(split: shard_manifest.Split, rank: int, world: int, workers: int, batch: int, training: bool = True,
               buffer: int = 7) -> shards.ShardStream:
    manifest = shard_manifest.Manifest("unused", ["a"], split, split)
    return shards.ShardStream(manifest, "train" if training else "val", rank, world, workers, batch,
                              transform=None, seed=3, shuffle_buffer=buffer, training=training)


def emitted(stream: shards.ShardStream, monkeypatch) -> list[list[int]]:
    """Per DataLoader worker, the record ids this rank's stream emits, in batch order."""
    batches: list[list[int]] = []
    per_worker = []
    for worker in range(stream.workers):
        monkeypatch.setattr(shards, "get_worker_info",
                            lambda w=worker: SimpleNamespace(id=w, num_workers=stream.workers))
        _, emit, sizes = stream.plan()
        rows, at = [], 0
        for size in sizes:
            rows.append(emit[at:at + size].tolist())
            at += size
        per_worker.append(rows)
    # The DataLoader takes one batch from each worker in turn.
    for turn in range(max(len(rows) for rows in per_worker)):
        batches += [rows[turn] for rows in per_worker if turn < len(rows)]
    return batches


def test_shards_are_permuted_by_seed_and_epoch():
    split = counts_split([5, 5, 5, 5, 5, 3])
    first = shard_order.epoch_sequence(split, seed=0, epoch=0)
    assert sorted(first.tolist()) == list(range(28))
    assert np.array_equal(first, shard_order.epoch_sequence(split, seed=0, epoch=0))
    assert not np.array_equal(first, shard_order.epoch_sequence(split, seed=0, epoch=1))
    assert not np.array_equal(first, shard_order.epoch_sequence(split, seed=1, epoch=0))
    # Records stay in runs of whole shards (sequential reads).
    starts = [value for value in first.tolist() if value in split.offsets[:-1].tolist()]
    assert len(starts) == 6
    order = shard_order.buffer_order(np.arange(100), 10, seed=5)
    assert sorted(order.tolist()) == list(range(100)) and order.tolist() != list(range(100))


@pytest.mark.parametrize("world, workers", [(1, 1), (2, 1), (2, 3), (3, 2)])
def test_every_rank_runs_the_same_steps_and_no_record_repeats_beyond_padding(world, workers, monkeypatch):
    split = counts_split([9, 11, 10, 7, 12, 4])   # 53 records
    batch = 4
    streams = [stream_for(split, rank, world, workers, batch) for rank in range(world)]
    per_rank = []
    for stream in streams:
        stream.set_epoch(2)
        per_rank.append(emitted(stream, monkeypatch))
    steps = {len(rows) for rows in per_rank}
    assert steps == {int(np.ceil(53 / world)) // batch}  # as the folder loader's padded sampler
    assert all(len(row) == batch for rows in per_rank for row in rows)
    seen = [record for rows in per_rank for row in rows for record in row]
    repeats = len(seen) - len(set(seen))
    assert repeats <= world                                     # the padding of short chunks only
    assert 53 - len(set(seen)) < world * batch                  # left out: under one global batch


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2])
def test_validation_sees_every_record_exactly_once(world, workers, monkeypatch):
    split = counts_split([6, 6, 6, 3])  # 21 records: uneven for 2 ranks and for batches of 4
    seen = []
    for rank in range(world):
        stream = stream_for(split, rank, world, workers, batch=4, training=False)
        seen += [record for row in emitted(stream, monkeypatch) for record in row]
    assert sorted(seen) == list(range(21))


def test_resume_with_the_same_ranks_continues_the_same_stream(monkeypatch):
    split = counts_split([9, 11, 10, 7, 12, 4])
    for workers in (1, 2, 3):
        for rank in range(2):
            full = stream_for(split, rank, 2, workers, 4)
            full.set_epoch(1)
            whole = emitted(full, monkeypatch)
            for done in (1, 2, 3):   # steps completed before the checkpoint
                saved = {"epoch": 1, "segments": [s.as_list() for s in full.segments], "consumed": [],
                         "total": done * 2 * 4}
                resumed = stream_for(split, rank, 2, workers, 4)
                resumed.load_state_dict(saved)
                resumed.set_epoch(1, start=done * 2 * 4)
                assert emitted(resumed, monkeypatch) == whole[done:]
                assert len(resumed) == len(whole) - done


def test_resume_with_other_ranks_sees_no_image_twice(monkeypatch):
    split = counts_split([9, 11, 10, 7, 12, 4, 8])   # 61 records
    batch = 4
    old = [stream_for(split, rank, 2, 2, batch) for rank in range(2)]
    consumed = []
    for stream in old:
        stream.set_epoch(0)
        consumed += [r for row in emitted(stream, monkeypatch)[:3] for r in row]   # 3 steps done
        stream.batches_taken = 3
    saved = old[0].state_dict()
    assert saved["total"] == 3 * 2 * batch
    for world in (1, 3):
        step = world * batch
        start = saved["total"] // step * step        # what the trainer passes (rounded down)
        new = [stream_for(split, rank, world, 1, batch) for rank in range(world)]
        rest = []
        for stream in new:
            stream.load_state_dict(saved)
            assert stream.state_dict() == saved   # what the resume broadcast sends on
            stream.set_epoch(0, start=start)
            rest.append([r for row in emitted(stream, monkeypatch) for r in row])
        assert len({len(r) for r in rest}) == 1                       # equal steps on every rank
        total_steps = int(np.ceil(61 / world)) // batch
        assert len(rest[0]) == (total_steps - start // step) * batch
        later = [r for rows in rest for r in rows]
        assert not set(later) & set(consumed)                         # nothing consumed is seen again
        assert 61 - len(set(consumed) | set(later)) < world * batch   # under one global batch left out
        assert "none seen twice" in new[0].notes[0]


def bad_shard(path: Path, good: bytes) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, data, label in (("00000000", good, 1), ("00000001", b"\xff\xd8\xffnot a jpeg", 2),
                                 ("00000002", good, 0), ("00000003", good, 1)):
            for name, payload in ((f"{key}.jpg", data), (f"{key}.cls", str(label).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                import io

                tar.addfile(info, io.BytesIO(payload))


def test_undecodable_records_are_replaced_in_training_and_dropped_in_validation(source, tmp_path):
    good = next((source / "train").rglob("*.JPEG")).read_bytes()
    bad_shard(tmp_path / "s.tar", good)
    split = counts_split([4])
    split.names = ["s.tar"]
    manifest = shard_manifest.Manifest(str(tmp_path), ["a", "b", "c"], split, split)
    cfg = Config()
    cfg.data.image_size = 16
    train = shards.ShardStream(manifest, "train", 0, 1, 0, 4, fast_train_transform(cfg.data), 0, 0, True)
    train.set_epoch(0)
    (images, labels, bad), = list(train)
    assert images.shape == (4, 3, 16, 16) and len(bad) == 1 and "s.tar:00000001" in bad[0]
    assert sorted(labels.tolist()) == [0, 1, 1, 1]  # the bad record took a good record's label
    val = shards.ShardStream(manifest, "val", 0, 1, 0, 4, fast_eval_transform(cfg.data), 0, 0, False)
    (images, labels, bad), = list(val)
    assert images.shape[0] == 3 and labels.tolist() == [1, 0, 1] and len(bad) == 1
    torch.manual_seed(0)


def test_progressive_resizing_reaches_the_shard_reader_and_its_workers(prepared):
    from torch.utils.data import DataLoader

    from hvdtrain.data.image.resolution import epoch_resolution

    cfg = Config()
    cfg.data.image_size, cfg.data.min_res, cfg.data.max_res, cfg.data.end_ramp = 32, 16, 32, 1
    manifest = shard_manifest.read_manifest(str(prepared))
    stream = shards.ShardStream(manifest, "train", 0, 1, 1, 8, fast_train_transform(cfg.data), 0, 0, True,
                                epoch_resolution(cfg.data))
    # One worker process (forkserver, as training uses): the schedule travels pickled with the stream.
    loader = DataLoader(stream, batch_size=None, num_workers=1, multiprocessing_context="forkserver")
    sizes = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        images, _, _ = next(iter(loader))
        sizes.append(tuple(images.shape[-2:]))
    assert sizes == [(16, 16), (32, 32)]


def test_missing_manifest_is_one_line(tmp_path):
    with pytest.raises(DataError, match="no manifest.json in data.dir"):
        shard_manifest.read_manifest(str(tmp_path))
