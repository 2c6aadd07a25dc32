"""Run folders shared with a group (``output.share=group``): a member of the group may read another
member's runs, never redirect, overwrite or prune their checkpoints, nor keep their runs out of their
folders by holding the lock. The member is a real second
Unix user (tests/users.py) in a real group with the user running the tests, in a project folder
both can write to."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import io as checkpoint
from hvdtrain.launch.job import Job
from hvdtrain.ownership import GROUP, UnsafePath, own_folder
from hvdtrain.train.run_claim import FolderRefused, claim_folder
from hvdtrain.train.run_folder import FIX, output_dir_problem
from tests import users


def payload(step: int) -> dict:
    return {"model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "epoch": 0, "step": step, "config": {}}


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Each file of ``folder``: its bytes and inode (a hard link is the same file)."""
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in sorted(folder.iterdir())}


def make_run(folder: Path, steps: tuple[int, ...], best: int) -> dict[str, tuple[bytes, int]]:
    """A finished run's checkpoints (``last.pt``, ``best.pt``, ``step-*.pt``), made by its own saver."""
    saver = checkpoint.CheckpointSaver(folder, keep=len(steps), share=GROUP)
    for step in steps:
        saver.save(payload(step), is_best=step == best)
    saver.close()
    return snapshot(folder)


def attempt(script: str) -> subprocess.CompletedProcess:
    """The shell ``script`` run as the second user, failing or not."""
    return subprocess.run(["runuser", "-u", users.ATTACKER, "--", "sh", "-c", script], capture_output=True,
                          text=True, timeout=60)


@pytest.fixture
def team():
    """A project folder (root-owned, of a group the second user is in, 2770: the group may write,
    no sticky bit) in a scratch folder; removed afterwards."""
    if users.why_not():
        pytest.skip(users.why_not())
    users.user()
    group = users.group([users.ATTACKER])
    scratch = users.scratch()
    folder = scratch / "team"
    folder.mkdir()
    os.chown(folder, 0, group.gr_gid)
    folder.chmod(0o2770)  # setgid: what is made in it is the group's
    try:
        yield folder
    finally:
        shutil.rmtree(scratch)


# --- a shared folder above a run folder -----------------------------------------------------------------

@pytest.mark.parametrize("bits, whom", [(0o2770, "its group"), (0o0777, "anyone")])
def test_a_shared_folder_above_without_the_sticky_bit_is_refused(team, bits, whom):
    team.chmod(bits)
    (team / "other").mkdir(mode=0o750)
    attempt_result = attempt(f"mv {team}/other {team}/other.moved")  # what a member could do to a run folder
    assert attempt_result.returncode == 0 and (team / "other.moved").is_dir(), attempt_result.stderr
    with pytest.raises(UnsafePath) as error:
        own_folder(team / "run", GROUP, what="output folder", fix=FIX)
    line = str(error.value)
    assert line == (f"the output folder '{team / 'run'}' is not safe to write into: the folder {team} above it "
                    f"can be written by {whom} (owner root, mode {bits:04o}) without the sticky bit, so another "
                    f"user could rename what is in it; have its owner run chmod +t '{team}' (the sticky bit, as "
                    f"/tmp has), or {FIX}")
    assert output_dir_problem(team / "run", GROUP) == line and not (team / "run").exists()
    team.chmod(bits | stat.S_ISVTX)  # the fix: nobody but an entry's owner may rename it
    assert output_dir_problem(team / "run", GROUP) is None and (team / "run").is_dir()
    refused = attempt(f"mv {team}/run {team}/run.moved")
    assert refused.returncode != 0 and "Operation not permitted" in refused.stderr
    assert (team / "run").is_dir() and not (team / "run.moved").exists()


# --- checkpoints go where the folder was checked --------------------------------------------------------

def test_a_rename_between_the_check_and_the_write_redirects_nothing(tmp_path, monkeypatch):
    """Deterministic: the swap happens inside the save, right after its check of the folder."""
    team = tmp_path / "team"
    other = make_run(team / "b" / "checkpoints", (7, 8), best=7)
    saver = checkpoint.CheckpointSaver(team / "a" / "checkpoints", keep=1, share=GROUP)
    checked = checkpoint.folder_descriptor_problem

    def check_then_swap(*args):
        found = checked(*args)
        (team / "a").rename(team / "a.moved")  # run a's folder out of the way, run b's in its place
        (team / "b").rename(team / "a")
        monkeypatch.setattr(checkpoint, "folder_descriptor_problem", checked)  # once
        return found

    monkeypatch.setattr(checkpoint, "folder_descriptor_problem", check_then_swap)
    for step in (1, 2, 3):
        saver.save(payload(step), is_best=step == 2)
    assert snapshot(team / "a" / "checkpoints") == other  # run b's files, at run a's name: untouched
    moved = team / "a.moved" / "checkpoints"
    assert sorted(p.name for p in moved.iterdir()) == ["best.pt", "last.pt", "step-00000003.pt"]
    assert checkpoint.load(moved / "last.pt")["step"] == 3 and checkpoint.load(moved / "best.pt")["step"] == 2


def test_a_group_member_renaming_run_folders_mid_job_redirects_nothing(team):
    team.chmod(0o3770)  # accepted when the job starts: sticky
    other = make_run(team / "b" / "checkpoints", (7, 8), best=7)
    saver = checkpoint.CheckpointSaver(team / "a" / "checkpoints", keep=1, share=GROUP)
    saver.save(payload(1), is_best=True)
    team.chmod(0o2770)  # its owner takes the sticky bit away while the job runs
    users.as_user(users.ATTACKER, f"mv {team}/a {team}/a.moved && mv {team}/b {team}/a")
    for step in (2, 3):
        saver.save(payload(step), is_best=step == 2)
    assert snapshot(team / "a" / "checkpoints") == other  # last.pt, best.pt, step-7 and step-8 of run b
    moved = team / "a.moved" / "checkpoints"
    assert sorted(p.name for p in moved.iterdir()) == ["best.pt", "last.pt", "step-00000003.pt"]
    assert [checkpoint.load(moved / name)["step"] for name in ("last.pt", "best.pt")] == [3, 2]
    assert checkpoint.load(team / "a" / "checkpoints" / "last.pt")["step"] == 8


# --- the run folder's lock ----------------------------------------------------------------------------

HOLD = """
import fcntl, os, sys
try:
    fd = os.open(sys.argv[1], os.O_RDONLY)
except OSError as error:
    print("cannot open", error.errno, flush=True)
    sys.exit(0)
fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
print("locked", flush=True)
sys.stdin.read()
"""


def hold_lock(path: Path) -> subprocess.Popen:
    """The second user opening ``path`` and holding a shared lock on it until stdin closes."""
    return subprocess.Popen(["runuser", "-u", users.ATTACKER, "--", "/usr/bin/python3", "-c", HOLD, str(path)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_group_member_cannot_hold_the_lock_of_a_shared_run_folder(team):
    team.chmod(0o3770)
    run = team / "run"
    assert output_dir_problem(run, GROUP) is None and run.stat().st_gid == team.stat().st_gid  # the group reads it
    claim_folder(run, "auto", Job(), share=GROUP).release()  # a run that ended
    assert stat.S_IMODE((run / "run.lock").stat().st_mode) == 0o600
    member = hold_lock(run / "run.lock")
    try:
        assert member.stdout.readline() == f"cannot open {errno.EACCES}\n"
        assert users.as_user(users.ATTACKER, f"cat {run}/job.json").stdout.startswith("{")  # reading: shared
        claim = claim_folder(run, "auto", Job(), share=GROUP)  # the user's next run takes its folder
        assert claim.lock_fd is not None
        claim.release()
    finally:
        member.stdin.close()
        member.wait(timeout=30)


def test_an_older_lock_file_others_can_open_is_replaced_or_refused_truthfully(team):
    team.chmod(0o3770)
    run = team / "run"
    output_dir_problem(run, GROUP)
    (run / "run.lock").touch()
    (run / "run.lock").chmod(0o640)  # what an older hvdtrain left with output.share=group
    claim = claim_folder(run, "auto", Job(), share=GROUP)  # nobody holds it: a fresh 0600 file in its place
    claim.release()
    assert stat.S_IMODE((run / "run.lock").stat().st_mode) == 0o600
    (run / "run.lock").chmod(0o640)
    member = hold_lock(run / "run.lock")
    try:
        assert member.stdout.readline() == "locked\n"
        with pytest.raises(FolderRefused) as refused:
            claim_folder(run, "auto", Job(), share=GROUP)
        assert str(refused.value) == (
            f"the output folder's lock file {run / 'run.lock'} can be opened by others (owner root, mode 0640, an "
            f"older hvdtrain's) and is locked: if no run of yours uses '{run}', delete that file and start again")
        (run / "run.lock").unlink()  # the fix; the member's open file no longer counts
        claim = claim_folder(run, "auto", Job(), share=GROUP)
        assert claim.lock_fd is not None
        claim.release()
    finally:
        member.stdin.close()
        member.wait(timeout=30)
