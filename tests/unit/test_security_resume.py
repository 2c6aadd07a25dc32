"""A checkpoint another user owns, or that others can write, is never resumed (checkpoint.resume=auto
or a file): one line names the file, its owner and the fix, checked on the descriptor that is then
read. ``evaluate`` still reads a checkpoint the user names, whoever owns it: it only reads."""

from __future__ import annotations

import grp
import os
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import io as checkpoint
from tests import users

needs_users = pytest.mark.skipif(users.why_not() is not None, reason=str(users.why_not()))


def own_checkpoint(folder: Path) -> Path:
    saver = checkpoint.CheckpointSaver(folder, keep=1)
    return saver.save({"model": {"w": torch.ones(2)}, "optimizer": {}, "epoch": 1, "step": 4, "config": {}}, False)


def test_a_checkpoint_others_can_write_is_not_resumed(tmp_path):
    folder = tmp_path / "checkpoints"
    own_checkpoint(folder)
    found = checkpoint.load_for_resume("auto", folder, print)
    assert found[0] == folder / "last.pt" and found[1]["step"] == 4
    (folder / "last.pt").chmod(0o666)  # the same inode as step-00000004.pt: no older file is trusted either
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.load_for_resume("auto", folder, print)
    assert str(error.value) == (
        f"checkpoint '{folder / 'last.pt'}' is not resumed: {folder / 'last.pt'} can be written by others (owner "
        f"root, mode 0666), so it could have been replaced; delete it (or the run folder), or copy a checkpoint you "
        f"trust into a folder of yours and set checkpoint.resume to the copy")
    with pytest.raises(checkpoint.CheckpointError, match="is not resumed"):
        checkpoint.load_for_resume(str(folder / "last.pt"), folder, print)
    assert checkpoint.load(folder / "last.pt")["step"] == 4  # evaluate reads a file the user names
    (folder / "last.pt").chmod(0o664)  # its group may write: only a run folder shared with the group takes it
    os.chown(folder / "last.pt", -1, grp.getgrnam("users").gr_gid)  # a group others are in, not root's own
    with pytest.raises(checkpoint.CheckpointError, match="can be written by others"):
        checkpoint.load_for_resume("auto", folder, print)
    assert checkpoint.load_for_resume("auto", folder, print, share="group")[1]["step"] == 4


@needs_users
def test_a_checkpoint_another_user_owns_is_not_resumed(tmp_path):
    folder = tmp_path / "checkpoints"
    own_checkpoint(folder)
    os.chown(folder / "last.pt", users.user().pw_uid, -1)
    with pytest.raises(checkpoint.CheckpointError) as error:
        checkpoint.load_for_resume("auto", folder, print)
    assert f"belongs to {users.ATTACKER} (owner {users.ATTACKER}, mode 0600)" in str(error.value)
    assert "\n" not in str(error.value)
