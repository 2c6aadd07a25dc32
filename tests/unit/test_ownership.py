"""The one ownership rule (hvdtrain/ownership.py): which folders hvdtrain writes into, how it writes
files without following links, and which files it trusts as its own state."""

from __future__ import annotations

import grp
import os
import shutil
import stat
from pathlib import Path

import pytest

from hvdtrain import ownership
from hvdtrain.ownership import (
    GROUP,
    UMASK,
    UnsafePath,
    folder_problem,
    open_append,
    open_trusted,
    own_folder,
    private_group,
    trust_problem,
    write_atomic,
)
from tests import users

needs_users = pytest.mark.skipif(users.why_not() is not None, reason=str(users.why_not()))


@pytest.fixture
def attacker() -> int:
    """The uid of another user (who plants files); root is needed to act for them."""
    if users.why_not():
        pytest.skip(users.why_not())
    return users.user().pw_uid


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


# --- folders -----------------------------------------------------------------------------------------

def test_folders_are_made_private_or_group_readable(tmp_path, umask_022):
    made = own_folder(tmp_path / "a" / "b" / "run")
    assert made == tmp_path / "a" / "b" / "run" and made.is_dir()
    assert [mode(p) for p in (tmp_path / "a", tmp_path / "a" / "b", made)] == [0o700] * 3
    shared = own_folder(tmp_path / "team" / "run", share=GROUP)
    assert mode(shared) == 0o750 and mode(tmp_path / "team") == 0o750
    published = own_folder(tmp_path / "shards", share=UMASK)  # readable as the umask allows, never writable
    assert mode(published) == 0o755
    write_atomic(published / "manifest.json", "{}", share=UMASK)
    assert mode(published / "manifest.json") == 0o644
    os.umask(0o002)  # a user-private group's umask: still nobody else writes
    assert mode(own_folder(tmp_path / "shards2", share=UMASK)) == 0o755


def test_an_existing_folder_of_ones_own_is_used_as_it_is(tmp_path, umask_022):
    (tmp_path / "run").mkdir(mode=0o755)
    assert own_folder(tmp_path / "run") == tmp_path / "run" and mode(tmp_path / "run") == 0o755
    assert own_folder(tmp_path / "run") == tmp_path / "run"  # twice: nothing changes


def shared_group() -> int:
    """A group other users belong to (Debian's "users"), not the user's private one."""
    return grp.getgrnam("users").gr_gid


@pytest.mark.parametrize("bits, whom", [(0o777, "anyone"), (0o775, "its group")])
def test_a_folder_of_ones_own_that_others_can_write_is_refused(tmp_path, bits, whom):
    (tmp_path / "run").mkdir()
    (tmp_path / "run").chmod(bits)
    os.chown(tmp_path / "run", -1, shared_group())
    with pytest.raises(UnsafePath) as error:
        own_folder(tmp_path / "run", what="output folder", fix="set output.dir=/a/folder/of/yours")
    message = str(error.value)
    assert "\n" not in message and f"the output folder '{tmp_path / 'run'}' is not safe to write into" in message
    assert f"can be written by {whom}" in message and f"run chmod go-w '{tmp_path / 'run'}'" in message
    if bits == 0o775:
        assert own_folder(tmp_path / "run", share=GROUP)  # shared with the group on purpose


def test_the_write_bit_of_a_users_private_group_lets_nobody_else_in(attacker):
    """Debian and Red Hat give each user a group of their own and umask 002: a user's folders and
    files are group-writable, and only they are in the group. That is not "others"."""
    me = users.user()
    assert private_group(me.pw_gid, me.pw_uid)  # useradd made the group of the same name
    assert not private_group(shared_group(), me.pw_uid)
    scratch = users.scratch()
    try:
        # The rule as that user sees it: the module alone (standard library only), from a copy they can read.
        shutil.copy(Path(ownership.__file__), scratch / "rule.py")
        folder = scratch / "project" / "run"
        folder.mkdir(parents=True)
        for path in (folder.parent, folder):
            path.chmod(0o775)
            os.chown(path, me.pw_uid, me.pw_gid)
        check = f"/usr/bin/python3 -c 'import rule; print(rule.folder_problem(\"{folder}\"))'"
        assert users.as_user(me.pw_name, check, cwd=scratch).stdout.strip() == "None"
        os.chown(folder, me.pw_uid, shared_group())
        assert "can be written by its group" in users.as_user(me.pw_name, check, cwd=scratch).stdout
    finally:
        shutil.rmtree(scratch)


def test_a_folder_another_user_owns_is_refused(tmp_path, attacker):
    folder = tmp_path / "run"
    folder.mkdir(mode=0o755)
    os.chown(folder, attacker, -1)
    with pytest.raises(UnsafePath) as error:
        own_folder(folder, what="output folder", fix="set output.dir=/a/folder/of/yours")
    assert str(error.value) == (f"the output folder '{folder}' is not safe to write into: {folder} belongs to "
                                f"{users.ATTACKER} (owner {users.ATTACKER}, mode 0755); "
                                f"set output.dir=/a/folder/of/yours")


def test_folders_above_decide_who_could_swap_it(tmp_path, attacker):
    above = tmp_path / "above"
    above.mkdir()
    above.chmod(0o1777)  # a scratch folder: anyone may write, nobody may rename another's entry
    assert folder_problem(above / "run") is None and own_folder(above / "run").is_dir()
    above.chmod(0o777)   # without the sticky bit anyone could rename run/ and put a link there
    assert "above it can be written by anyone" in folder_problem(above / "run")
    assert "can be written by anyone" in folder_problem(above / "run", share=GROUP)
    above.chmod(0o2770)  # a project folder: a member could rename run/ too, shared with or not
    os.chown(above, -1, shared_group())
    assert "above it can be written by its group" in folder_problem(above / "run")
    assert "above it can be written by its group" in folder_problem(above / "run", share=GROUP)
    above.chmod(0o3770)  # the sticky bit: only an entry's owner may rename it
    assert folder_problem(above / "run") is None and folder_problem(above / "run", share=GROUP) is None
    above.chmod(0o1777)
    os.chown(above, attacker, -1)  # its owner can rename anything in it, sticky or not
    assert f"belongs to {users.ATTACKER}, who could swap it" in folder_problem(above / "run")
    with pytest.raises(UnsafePath, match="above it belongs to sec49b"):
        own_folder(above / "new")
    assert not (above / "new").exists()


def test_a_link_another_user_owns_is_not_followed(tmp_path, attacker):
    scratch = tmp_path / "scratch"
    scratch.mkdir(mode=0o1777)
    scratch.chmod(0o1777)
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    (scratch / "run").symlink_to(home)
    os.lchown(scratch / "run", attacker, -1)
    with pytest.raises(UnsafePath, match=f"is a link that {users.ATTACKER} owns"):
        own_folder(scratch / "run" / "sub")
    assert not (home / "sub").exists()
    os.lchown(scratch / "run", 0, 0)  # one's own link (or root's) is followed
    assert own_folder(scratch / "run" / "sub") == scratch / "run" / "sub" and (home / "sub").is_dir()


def test_a_file_in_the_way_is_not_a_folder(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(UnsafePath, match="is not a folder|cannot create"):
        own_folder(tmp_path / "run")


# --- writing -----------------------------------------------------------------------------------------

def test_appending_never_follows_a_link(tmp_path, umask_022):
    victim = tmp_path / "notes.txt"
    victim.write_text("the victim's notes\n")
    (tmp_path / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(OSError):
        open_append(tmp_path / "metrics.jsonl")
    os.link(victim, tmp_path / "attempts.jsonl")  # a hard link leads to the same file
    with pytest.raises(PermissionError, match="has 2 names"):
        open_append(tmp_path / "attempts.jsonl")
    assert victim.read_text() == "the victim's notes\n"
    with open_append(tmp_path / "fresh.jsonl") as handle:
        handle.write("{}\n")
    with open_append(tmp_path / "fresh.jsonl") as handle:
        handle.write("{}\n")
    assert (tmp_path / "fresh.jsonl").read_text() == "{}\n{}\n" and mode(tmp_path / "fresh.jsonl") == 0o600
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(OSError):  # no reader: refused at once, never blocks
        open_append(tmp_path / "fifo")


def test_appending_to_another_users_file_is_refused(tmp_path, attacker):
    planted = tmp_path / "metrics.jsonl"
    planted.write_text("")
    os.chown(planted, attacker, -1)
    with pytest.raises(PermissionError, match=f"it belongs to {users.ATTACKER}"):
        open_append(planted)


def test_a_whole_file_replaces_a_planted_link(tmp_path, umask_022):
    victim = tmp_path / "bashrc"
    victim.write_text("the victim's shell setup\n")
    (tmp_path / "config.yaml").symlink_to(victim)
    write_atomic(tmp_path / "config.yaml", "seed: 0\n")
    assert victim.read_text() == "the victim's shell setup\n"
    assert not (tmp_path / "config.yaml").is_symlink() and (tmp_path / "config.yaml").read_text() == "seed: 0\n"
    assert mode(tmp_path / "config.yaml") == 0o600
    write_atomic(tmp_path / "shared.yaml", b"x", share=GROUP, sync=True)
    assert mode(tmp_path / "shared.yaml") == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bashrc", "config.yaml", "shared.yaml"]  # no temporaries


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    write_atomic(tmp_path / "summary.txt", "old\n")

    def broken(handle):
        handle.write(b"half")
        raise RuntimeError("disk gone")

    from hvdtrain.ownership import replace_file

    with pytest.raises(RuntimeError):
        replace_file(tmp_path / "summary.txt", broken)
    assert (tmp_path / "summary.txt").read_text() == "old\n" and len(list(tmp_path.iterdir())) == 1


# --- trusting ----------------------------------------------------------------------------------------

def test_ones_own_private_file_is_trusted(tmp_path):
    path = tmp_path / "last.pt"
    path.write_bytes(b"state")
    path.chmod(0o644)
    descriptor = open_trusted(path)
    try:
        assert os.read(descriptor, 10) == b"state"
    finally:
        os.close(descriptor)
    path.chmod(0o666)
    with pytest.raises(UnsafePath, match=r"can be written by others \(owner \w+, mode 0666\)"):
        open_trusted(path)
    path.chmod(0o664)
    os.chown(path, -1, shared_group())  # a group other users are in (a user's private group would not count)
    assert trust_problem(path.stat(), path) and trust_problem(path.stat(), path, share=GROUP) is None


def test_another_users_file_or_link_is_not_trusted(tmp_path, attacker):
    path = tmp_path / "last.pt"
    path.write_bytes(b"state")
    path.chmod(0o600)
    os.chown(path, attacker, -1)
    with pytest.raises(UnsafePath) as error:
        open_trusted(path)
    assert str(error.value) == f"{path} belongs to {users.ATTACKER} (owner {users.ATTACKER}, mode 0600)"
    mine = tmp_path / "mine.pt"
    mine.write_bytes(b"mine")
    (tmp_path / "link.pt").symlink_to(mine)
    os.close(open_trusted(tmp_path / "link.pt"))  # one's own link to one's own file
    os.lchown(tmp_path / "link.pt", attacker, -1)
    with pytest.raises(UnsafePath, match=f"is a link that {users.ATTACKER} owns"):
        open_trusted(tmp_path / "link.pt")


def test_a_fifo_is_not_trusted_and_does_not_block(tmp_path):
    os.mkfifo(tmp_path / "index")
    with pytest.raises(UnsafePath, match="not a regular file"):
        open_trusted(tmp_path / "index")
    with pytest.raises(FileNotFoundError):
        open_trusted(tmp_path / "missing")


@needs_users
def test_what_another_user_planted_in_a_scratch_folder():
    """The same rules with files that another user really made (runuser), in a folder like /scratch."""
    users.user()
    scratch = users.scratch()
    try:
        users.as_user(users.ATTACKER, "mkdir -m 777 run && ln -s /root/.bashrc_test run/config.yaml && "
                      "mkdir -m 755 mine_too", cwd=scratch)
        with pytest.raises(UnsafePath, match=f"belongs to {users.ATTACKER}"):
            own_folder(scratch / "run")
        with pytest.raises(UnsafePath, match=f"belongs to {users.ATTACKER}"):
            own_folder(scratch / "mine_too" / "run")  # would be made inside her folder
        assert own_folder(scratch / "own").stat().st_uid == os.geteuid()
    finally:
        shutil.rmtree(scratch)
