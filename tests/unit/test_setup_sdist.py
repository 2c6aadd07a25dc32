"""The Horovod sdist setup compiles (scripts/sdist-check.sh, run here on its own with a fake sdist and
its sum: the real setup takes many minutes): copied once into a private folder, the copy checked and
the copy unpacked; a cache folder or an HOROVOD_SDIST that another user can write is refused in one
line. The other user is a real one (tests/users.py)."""

from __future__ import annotations

import grp
import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from tests import users

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "sdist-check.sh"
NAME = "horovod-0.28.1.tar.gz"


def fake_sdist(path: Path, text: str = "print('the real setup.py')\n") -> str:
    """A small sdist at ``path`` (mode 0644); its SHA-256."""
    data = text.encode()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        member = tarfile.TarInfo("horovod-0.28.1/setup.py")
        member.size = len(data)
        archive.addfile(member, io.BytesIO(data))
    path.write_bytes(buffer.getvalue())
    path.chmod(0o644)
    return hashlib.sha256(buffer.getvalue()).hexdigest()


def run(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), *map(str, args)], capture_output=True, text=True, timeout=30)


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A private setup cache (0755, the user's) holding a fake sdist, and a private destination folder."""
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    (tmp_path / "checked").mkdir(mode=0o700)
    return folder


def test_the_copy_is_what_is_checked_and_unpacked(cache, tmp_path):
    sha = fake_sdist(cache / NAME)
    assert run("cache", cache).returncode == 0
    result = run("sdist", cache / NAME, sha, tmp_path / "checked")
    assert result.returncode == 0, result.stderr
    copy = Path(result.stdout.strip())
    assert copy == tmp_path / "checked" / NAME and copy.read_bytes() == (cache / NAME).read_bytes()
    # setup.sh unpacks the copy, never the name it checked
    setup = (REPO / "scripts" / "setup.sh").read_text()
    block = setup[setup.index("private_cache \"$cache\""):setup.index("src=$src/horovod-$horovod_version")]
    assert 'checked_sdist "$sdist" "$horovod_sha256" "$checked_dir" || {' in block
    assert 'tar -xzf "$checked_sdist" -C "$src"' in block and "sha256sum" not in block
    assert '"$sdist"' not in block.split("checked_sdist \"$sdist\"")[1]  # no use of the name after the check
    assert 'source "$repo/scripts/sdist-check.sh"' in setup and '"$repo/scripts/sdist-check.sh"' in \
        setup[setup.index("stamp=$("):setup.index("| sha256sum")]


def test_a_wrong_sum_is_refused_and_leaves_no_copy(cache, tmp_path):
    fake_sdist(cache / NAME, "import os; os.system('id')\n")
    result = run("sdist", cache / NAME, "0" * 64, tmp_path / "checked")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"sdist-check: checksum mismatch for {cache / NAME}: sha256 ")
    assert list((tmp_path / "checked").iterdir()) == []


@pytest.mark.parametrize("where, mode, says", [
    ("cache", 0o775, "the setup cache {cache} can be written by others than you and root"),
    ("cache", 0o1777, "the setup cache {cache} can be written by others than you and root"),
    ("above", 0o777, "the folder {above} above the setup cache {cache} can be changed by others"),
], ids=["cache-group", "cache-sticky-all", "above-all"])
def test_a_cache_others_can_write_is_refused(cache, tmp_path, where, mode, says):
    above = tmp_path / "above"
    above.mkdir()
    folder = above / "cache"
    changed = {"cache": folder, "above": above}[where]
    changed.mkdir(exist_ok=True)
    changed.chmod(mode)
    os.chown(changed, -1, grp.getgrnam("users").gr_gid)  # a group others are in, not root's own
    result = run("cache", folder)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("sdist-check: " + says.format(cache=folder, above=above))
    assert "HVDTRAIN_CACHE" in lines[0]
    above.chmod(0o1777)  # a sticky folder above (/tmp) is fine; the cache itself must be private
    folder.chmod(0o755)
    assert run("cache", folder).returncode == 0


def test_a_missing_cache_is_made(tmp_path):
    assert run("cache", tmp_path / "new" / "cache").returncode == 0 and (tmp_path / "new" / "cache").is_dir()


def test_an_sdist_others_can_write_is_refused(cache, tmp_path):
    sha = fake_sdist(cache / NAME)
    (cache / NAME).chmod(0o666)
    result = run("sdist", cache / NAME, sha, tmp_path / "checked")
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"sdist-check: the Horovod sdist {cache / NAME} can be written by others")
    assert "HOROVOD_SDIST" in result.stderr and list((tmp_path / "checked").iterdir()) == []


@pytest.mark.skipif(users.why_not() is not None, reason=str(users.why_not()))
def test_another_users_cache_sdist_or_link_is_refused(tmp_path):
    """As a real second user: a cache folder of theirs, an sdist of theirs, a link of theirs on the way."""
    other = users.user()
    scratch = users.scratch()
    try:
        users.as_user(other.pw_name, "mkdir -m 755 cache && mkdir -m 755 mine", cwd=scratch)
        result = run("cache", scratch / "cache")
        assert result.returncode == 1 and "can be written by others than you and root (owner uid " \
            f"{other.pw_uid}, mode 755)" in result.stderr and result.stderr.count("\n") == 1
        sdist = scratch / "mine" / NAME
        sha = fake_sdist(tmp_path / NAME)
        shutil.copy(tmp_path / NAME, sdist)
        os.chown(sdist, other.pw_uid, -1)
        (tmp_path / "checked").mkdir(mode=0o700)
        result = run("sdist", sdist, sha, tmp_path / "checked")
        assert result.returncode == 1 and f"the Horovod sdist {sdist} can be written by others" in result.stderr
        (tmp_path / "home").mkdir(mode=0o755)
        users.as_user(other.pw_name, f"ln -s {tmp_path / 'home'} link", cwd=scratch)
        result = run("cache", scratch / "link" / "cache")
        assert result.returncode == 1 and f"{scratch / 'link'} is a link that uid {other.pw_uid} owns" in result.stderr
        assert not (tmp_path / "home" / "cache").exists()  # nothing made through it
    finally:
        shutil.rmtree(scratch)


@pytest.mark.skipif(users.why_not() is not None, reason=str(users.why_not()))
def test_the_write_bit_of_a_users_private_group_lets_nobody_else_in():
    """Under umask 002 a user's folders are writable by their own group, whom nobody else is in: that
    cache is theirs alone. The same folder of a group others are in is refused."""
    me = users.user()
    scratch = users.scratch()
    try:
        (scratch / "bin").mkdir()
        for name in ("sdist-check.sh", "owner-check.sh"):  # the scripts, where that user can read them
            shutil.copy(REPO / "scripts" / name, scratch / "bin" / name)
        users.as_user(me.pw_name, "umask 002 && mkdir -p home/cache", cwd=scratch)
        cache = scratch / "home" / "cache"
        assert stat.S_IMODE(cache.stat().st_mode) == 0o775 and cache.stat().st_gid == me.pw_gid
        users.as_user(me.pw_name, f"bash bin/sdist-check.sh cache {cache}", cwd=scratch)  # accepted
        os.chown(cache, -1, grp.getgrnam("users").gr_gid)
        refused = subprocess.run(["runuser", "-u", me.pw_name, "--", "bash", str(scratch / "bin" / "sdist-check.sh"),
                                  "cache", str(cache)], capture_output=True, text=True, timeout=30)
        assert refused.returncode == 1 and f"the setup cache {cache} can be written by others" in refused.stderr
    finally:
        shutil.rmtree(scratch)
