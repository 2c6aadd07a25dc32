"""``hvdtrain prepare`` on another user's source folder: a file that user swaps for a link to one of
the victim's private images after the link check is never read (each file is opened once and
checked on that descriptor), and the shards are private unless the user asks for more. The other
user is made with ``useradd`` (tests/users.py)."""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from pathlib import Path

import pytest

from hvdtrain.cli import main
from hvdtrain.data.demo import generate
from hvdtrain.tools import prepare as prepare_module
from hvdtrain.tools.prepare import prepare
from hvdtrain.tools.prepare_source import LeftSource, open_source
from tests import users


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def shard_bytes(dst: Path) -> bytes:
    found = b""
    for shard in sorted(dst.glob("*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                found += tar.extractfile(member).read()
    return found


@pytest.fixture
def shared_source():
    """(the scratch folder, the attacker's source data set in it, the victim's private image)."""
    if users.why_not():
        pytest.skip(users.why_not())
    attacker = users.user()
    folder = users.scratch()
    source = folder / "src"
    generate(source, train_per_class=3, val_per_class=2, size=16, num_classes=2)
    for path in [source, *source.rglob("*")]:
        os.chown(path, attacker.pw_uid, attacker.pw_gid)
    home = users.victim_home(folder)
    secret = home / "private.png"
    secret.write_bytes(next(source.rglob("*.JPEG")).read_bytes() + b"victim's private photo")
    secret.chmod(0o600)
    yield folder, source, secret
    shutil.rmtree(folder)


def test_a_file_swapped_for_a_link_after_the_check_is_never_read(shared_source, monkeypatch, tmp_path):
    folder, source, secret = shared_source
    train_class = sorted((source / "train").iterdir())[0]
    swapped = sorted(train_class.iterdir())[0]
    checked = prepare_module.outside_links

    def check_then_swap(src, split, paths):  # the attacker acts right after the link check
        found = checked(src, split, paths)
        if split == "train":
            users.as_user(users.ATTACKER, f"rm {swapped} && ln -s {secret} {swapped}", cwd=folder)
        return found

    monkeypatch.setattr(prepare_module, "outside_links", check_then_swap)
    with pytest.raises(LeftSource) as refused:
        prepare(source, tmp_path / "out", progress=False)
    line = str(refused.value)
    assert line.startswith(f"{swapped} leads outside {source} (to {secret}) since the scan") and "\n" not in line
    assert swapped.is_symlink()
    assert b"victim's private photo" not in shard_bytes(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.tar")) and not list((tmp_path / "out").glob(".*.tmp-*"))


def test_the_open_is_the_check(shared_source):
    folder, source, secret = shared_source
    inside = str(source) + os.sep
    linked = source / "train" / "to_secret.png"
    users.as_user(users.ATTACKER, f"ln -s {secret} {linked} && ln -s {secret} {folder}/elsewhere.png", cwd=folder)
    with pytest.raises(LeftSource, match=f"^{linked} leads outside {source} \\(to {secret}\\)"):
        open_source(str(linked), inside)
    inner = source / "train" / "inner.png"
    users.as_user(users.ATTACKER, f"ln -s {next(source.rglob('*.JPEG'))} {inner}", cwd=folder)
    os.close(open_source(str(inner), inside))  # a link that stays inside the source is followed
    os.close(open_source(str(linked), None))  # --follow-links
    users.as_user(users.ATTACKER, f"mkfifo {source}/train/fifo.png", cwd=folder)
    with pytest.raises(OSError, match="not a regular file"):
        open_source(str(source / "train" / "fifo.png"), inside)  # returns at once: O_NONBLOCK


def test_shards_are_private_unless_shared_on_purpose(tmp_path, capsys):
    source = tmp_path / "src"
    generate(source, train_per_class=3, val_per_class=2, size=16, num_classes=2)
    old = os.umask(0o022)
    try:
        assert main(["prepare", str(source), str(tmp_path / "private"), "--no-progress"]) == 0
        assert main(["prepare", str(source), str(tmp_path / "everyone"), "--no-progress", "--share", "everyone"]) == 0
        assert main(["prepare", str(source), str(tmp_path / "group"), "--no-progress", "--share", "group"]) == 0
    finally:
        os.umask(old)
    for name, folder_mode, file_mode in (("private", 0o700, 0o600), ("group", 0o750, 0o640),
                                         ("everyone", 0o755, 0o644)):
        out = tmp_path / name
        files = [out / "manifest.json", *out.glob("*.tar")]
        assert len(files) == 3 and mode(out) == folder_mode, name
        assert {mode(path) for path in files} == {file_mode}, name
