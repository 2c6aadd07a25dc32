"""The file-index cache (HVDTRAIN_CACHE or ~/.cache/hvdtrain) is trusted only from the user: its
folder must be the user's (made 0700), a cache file another user owns or can write is a miss, and
so is one whose paths leave data.dir (absolute, or through ``..``): rebuilt from a scan, never
trained on."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hvdtrain.config import DataConfig
from hvdtrain.data.demo import generate
from hvdtrain.data.files.index import FileIndex, SplitIndex, build_index, cache_file, cache_key, encode, store
from tests import users


def attacker_uid() -> int:
    if users.why_not():
        pytest.skip(users.why_not())
    return users.user().pw_uid


@pytest.fixture
def dataset(tmp_path) -> Path:
    root = tmp_path / "data"
    generate(root, train_per_class=3, val_per_class=2, size=16, num_classes=2)
    return root


def plant_index(root: Path, cache: Path, paths: list[str]) -> Path:
    """A cache file with the right key, made with hvdtrain's own functions, listing ``paths`` (all label 1)."""
    index = build_index(root, None)
    forged = FileIndex(str(root), SplitIndex(list(index.train.classes), paths, [1] * len(paths)),
                       SplitIndex(list(index.val.classes), list(index.val.paths), list(index.val.labels)))
    target = cache_file(root, cache)
    target.parent.mkdir(parents=True, exist_ok=True)
    assert store(target, encode(cache_key(root), forged)) is not None
    return target


def test_a_cached_index_whose_paths_leave_data_dir_is_a_miss(dataset, tmp_path):
    cache = tmp_path / "cache"
    plant_index(dataset, cache, ["../../../../home/victim/notes.txt", "horizontal_0/x.JPEG"])
    index = build_index(dataset, cache)
    assert index.source == "scan" and all(".." not in p for p in index.train.paths)
    plant_index(dataset, cache, ["/etc/hostname"])
    assert build_index(dataset, cache).source == "scan"
    plant_index(dataset, cache, ["horizontal_0/a..b.JPEG"])  # '..' inside a name is a name
    assert build_index(dataset, cache).source == "cache"


def test_a_cache_file_another_user_owns_or_can_write_is_a_miss(dataset, tmp_path):
    cache = tmp_path / "cache"
    target = plant_index(dataset, cache, ["horizontal_0/x.JPEG"])
    target.chmod(0o666)
    assert build_index(dataset, cache).source == "scan"  # and rewritten, ours
    assert build_index(dataset, cache).source == "cache"
    os.chown(cache_file(dataset, cache), attacker_uid(), -1)
    index = build_index(dataset, cache)
    assert index.source == "scan" and list(index.train.labels) == sorted(index.train.labels)


def test_a_cache_folder_another_user_owns_is_not_used(dataset, tmp_path, capfd):
    cache = tmp_path / "cache"
    plant_index(dataset, cache, ["horizontal_0/x.JPEG"])
    os.chown(cache, attacker_uid(), -1)
    index = build_index(dataset, cache)
    assert index.source == "scan" and len(index.train) == 6
    err = capfd.readouterr().err
    assert f"belongs to {users.ATTACKER}" in err and "the file index is not cached" in err


def test_the_users_cache_folder_is_private(dataset, tmp_path, monkeypatch):
    monkeypatch.delenv("HVDTRAIN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    previous = os.umask(0o022)
    try:
        from hvdtrain.data.loaders import index_cache_dir

        build_index(dataset, index_cache_dir(DataConfig()))
    finally:
        os.umask(previous)
    for folder in (tmp_path / "xdg", tmp_path / "xdg" / "hvdtrain", tmp_path / "xdg" / "hvdtrain" / "file-index"):
        assert folder.stat().st_mode & 0o777 == 0o700, folder
