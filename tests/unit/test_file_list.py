"""Compact file lists: paths and labels in one shared buffer, read exactly as the lists
were, checked on load, and shared with loader workers by file descriptor instead of copied."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from hvdtrain.config import DataConfig
from hvdtrain.data.files.file_list import Buffer, IntArray, PathArray, decode_index, encode_index, host_budget
from hvdtrain.data.files.index import FileIndex, SplitIndex, build_index, cache_file, compact
from hvdtrain.data.loaders import loader_kwargs, shutdown_workers

NAMES = ["c0/a.JPEG", "c0/ünïcode é.jpg", "c1/sub/b.png", os.fsdecode(b"c1/\xff\xfe.JPEG"), "c1/" + "x" * 300, ""]


def split_of(paths: list[str], classes: int = 3) -> tuple[list[str], list[str], list[int]]:
    return [f"c{i}" for i in range(classes)], paths, [i % classes for i in range(len(paths))]


def index_buffer(paths: list[str], classes: int = 3) -> Buffer:
    return Buffer.in_memory(encode_index({"format": "test"}, {"train": split_of(paths, classes),
                                                              "val": split_of(paths[:1], classes)}))


@pytest.mark.parametrize("paths", [NAMES, [], ["only"], [f"n{i:08d}/n{i:08d}_{i}.JPEG" for i in range(70_000)]])
def test_paths_and_labels_read_back_exactly(paths):
    header, splits = decode_index(index_buffer(paths))
    classes, found, labels = splits["train"]
    assert isinstance(found, PathArray) and isinstance(labels, IntArray)
    assert len(found) == len(paths) and list(found) == paths and found == paths
    assert [found[i] for i in range(len(paths))] == paths and list(labels) == split_of(paths)[2]
    if paths:
        assert found[-1] == paths[-1] and found[1:3] == paths[1:3] and found.index(paths[-1]) == len(paths) - 1
        assert type(labels[0]) is int and labels == split_of(paths)[2]
    with pytest.raises(IndexError):
        found[len(paths)]
    assert header["format"] == "test" and splits["val"][1] == paths[:1]


def test_a_nul_inside_a_name_keeps_every_boundary():
    paths = ["a\0b", "c", "\0"]
    assert list(decode_index(index_buffer(paths))[1]["train"][1]) == paths


def test_labels_take_two_bytes_up_to_32767_classes_and_four_above():
    small = decode_index(index_buffer(["a", "b"], classes=21_841))[1]["train"][2]
    large = decode_index(index_buffer(["a", "b"], classes=40_000))[1]["train"][2]
    assert small.values.dtype == np.int16 and large.values.dtype == np.int32 and list(large) == [0, 1]


def test_split_index_equality_across_compact_and_lists(tmp_path):
    lists = FileIndex("root", SplitIndex(*split_of(NAMES)), SplitIndex(*split_of(NAMES[:2])))
    packed = compact(lists)
    assert packed.train == lists.train and lists.train == packed.train and packed.val == lists.val
    assert packed.train != lists.val and packed.nbytes == packed.buffer.size > 0
    assert "anonymous memory" in packed.sharing()


class Reader(Dataset):
    """What a loader worker sees: the path and label at an index, and how its buffer arrived."""

    def __init__(self, paths: PathArray, labels: IntArray):
        self.paths, self.labels = paths, labels

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int):
        return self.paths[index], self.labels[index], os.readlink(f"/proc/self/fd/{self.paths.buffer.fd}")


@pytest.mark.parametrize("context", ["forkserver", "spawn"])
def test_workers_map_the_cache_file_instead_of_unpickling_a_copy(context, tmp_path):
    root = tmp_path / "data"
    for split in ("train", "val"):
        for c in range(3):
            (root / split / f"c{c}").mkdir(parents=True)
            for i in range(40):
                (root / split / f"c{c}" / f"{i:03d}.jpg").write_bytes(b"")
    index = build_index(root, tmp_path / "cache")
    dataset = Reader(index.train.paths, index.train.labels)
    # Pickled for a starting worker: a file descriptor and a few numbers, whatever the list's size.
    popen = type("Popen", (), {"DupFd": staticmethod(lambda i: i), "duplicate_for_child": staticmethod(lambda fd: 0)})
    multiprocessing.context.set_spawning_popen(popen)
    try:
        for_worker = len(pickle.dumps(dataset))
    finally:
        multiprocessing.context.set_spawning_popen(None)
    assert for_worker < 600 < len(pickle.dumps(dataset)) and index.buffer.size > 4000

    kwargs = loader_kwargs(DataConfig(workers=2, mp_context=context), pin_memory=False)
    loader = DataLoader(dataset, batch_size=16, collate_fn=list, **kwargs)
    try:
        rows = [row for batch in loader for row in batch]
    finally:
        shutdown_workers(loader)
    assert [(p, label) for p, label, _ in rows] == list(zip(index.train.paths, index.train.labels))
    assert {target for _, _, target in rows} == {str(cache_file(root, tmp_path / "cache"))}


def test_in_memory_lists_leave_nothing_in_dev_shm(tmp_path):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    packed = compact(FileIndex("root", SplitIndex(*split_of(NAMES)), SplitIndex(*split_of([]))))
    target = os.readlink(f"/proc/self/fd/{packed.buffer.fd}")
    assert target.startswith("/memfd:hvdtrain-file-list") and list(packed.train.paths) == NAMES
    del packed
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == before


def test_pickled_elsewhere_it_carries_its_bytes():
    packed = compact(FileIndex("root", SplitIndex(*split_of(NAMES)), SplitIndex(*split_of(NAMES[:1]))))
    copy = pickle.loads(pickle.dumps(packed))
    assert copy.train == packed.train and copy.val == packed.val and copy.buffer.fd != packed.buffer.fd


def test_host_budget_line():
    line = host_budget(8, 2, 6, 55_300_000, "the index cache file, mapped")
    assert line == ("host budget: 8 rank(s) x 2 loaders x 6 workers = 96 loader workers on this host, sharing "
                    "a 55.3 MB file list (the index cache file, mapped)")
    assert "sharing a 12.3 kB file list" in host_budget(1, 2, 0, 12_345, "")


def test_torch_tensor_labels_and_numpy_views_work_as_lists():
    labels = decode_index(index_buffer(NAMES))[1]["train"][2]
    assert torch.tensor([labels[i] for i in range(3)]).tolist() == [0, 1, 2]
    assert np.asarray(labels).tolist() == split_of(NAMES)[2] and labels.nbytes == 2 * len(NAMES)


def test_cache_path_is_not_the_old_json_name(tmp_path):
    assert cache_file(Path("/data"), tmp_path).suffix == ".index"
