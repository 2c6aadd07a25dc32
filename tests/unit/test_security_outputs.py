"""What a run writes goes only into folders of the user's, never through a link another user
planted, private by default (0700 folders, 0600 files). Each writer is called directly here;
tests/parallel/test_planted_outputs.py runs the whole job once."""

from __future__ import annotations

import shutil
import stat
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import io as checkpoint
from hvdtrain.fault import attempts
from hvdtrain.observe.metrics import MetricsWriter
from hvdtrain.observe.rank_logs import write_host_map
from hvdtrain.ownership import write_atomic
from hvdtrain.train.run_folder import output_dir_problem, sharing_note
from tests import users

needs_users = pytest.mark.skipif(users.why_not() is not None, reason=str(users.why_not()))


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture
def scratch():
    """A world-writable folder like /scratch, the attacker (sec49b), and the victim's own files."""
    if users.why_not():
        pytest.skip(users.why_not())
    users.user()
    folder = users.scratch()
    yield folder, users.victim_home(folder)
    shutil.rmtree(folder)


# --- the run folder ------------------------------------------------------------------------------------

@needs_users
def test_a_run_folder_another_user_planted_is_refused_in_one_line(scratch):
    folder, home = scratch
    users.as_user(users.ATTACKER, users.PLANT.format(home=home), cwd=folder)
    problem = output_dir_problem(folder / "run")
    assert problem == (f"the output folder '{folder / 'run'}' is not safe to write into: {folder / 'run'} belongs to "
                       f"{users.ATTACKER} (owner {users.ATTACKER}, mode 0777); run from a folder you can write to "
                       f"(sbatch runs the job in the folder you submit from) or set output.dir=/a/folder/of/yours")
    users.untouched(home)


@needs_users
def test_a_subfolder_another_user_made_in_ones_run_folder_is_refused(scratch):
    folder, home = scratch
    run = folder / "mine"
    run.mkdir(mode=0o700)
    users.as_user(users.ATTACKER, "mkdir -m 777 checkpoints", cwd=folder)
    (folder / "checkpoints").rename(run / "checkpoints")  # planted while the folder was open to her
    assert f"checkpoints' is not safe to write into: {run / 'checkpoints'} belongs to {users.ATTACKER}" in \
        output_dir_problem(run)


def test_a_new_run_folder_is_private_and_the_start_up_line_says_when_shared(tmp_path, umask_022):
    assert output_dir_problem(tmp_path / "runs" / "a") is None
    assert mode(tmp_path / "runs") == mode(tmp_path / "runs" / "a") == 0o700
    assert sharing_note(tmp_path / "runs" / "a", "private") == ""
    assert output_dir_problem(tmp_path / "team" / "b", share="group") is None
    assert mode(tmp_path / "team" / "b") == 0o750
    assert sharing_note(tmp_path / "team" / "b", "group") == " (shared with group root on purpose: output.share=group)"


def test_every_writer_replaces_or_refuses_a_planted_link(tmp_path, umask_022):
    """A folder of one's own that was open once (planted then) and closed since: nothing written through."""
    home = tmp_path / "home"
    home.mkdir()
    victim = home / "notes.txt"
    victim.write_text("the victim's notes\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.yaml", "metrics.jsonl", "metrics_ranks.jsonl", "attempts.jsonl", "ranks.tsv"):
        (run / name).symlink_to(victim)
    write_atomic(run / "config.yaml", "seed: 0\n")                  # outputs.Outputs writes config.yaml so
    write_host_map(run, [(0, "node0", 11), (1, "node1", 12)])
    writer = MetricsWriter(run, tensorboard=False)
    writer.write({"split": "train", "epoch": 0, "loss": 1.0, "by_rank": [{"rank": 0}]})
    attempts.append(run, {"event": "start"})
    assert victim.read_text() == "the victim's notes\n"
    assert (run / "config.yaml").read_text() == "seed: 0\n" and mode(run / "config.yaml") == 0o600
    assert (run / "ranks.tsv").read_text().startswith("rank\thost\tpid\n") and mode(run / "ranks.tsv") == 0o600
    assert writer.lost == {"metrics.jsonl": 1, "metrics_ranks.jsonl": 1}  # refused, counted, training goes on
    for name in ("metrics.jsonl", "attempts.jsonl"):
        (run / name).unlink()
    fresh = MetricsWriter(run, tensorboard=False)
    fresh.write({"split": "train", "epoch": 0, "loss": 1.0})
    attempts.append(run, {"event": "start"})
    assert mode(run / "metrics.jsonl") == mode(run / "attempts.jsonl") == 0o600


def test_checkpoints_are_private_and_never_written_through_a_link(tmp_path, umask_022):
    victim = tmp_path / "victim.pt"
    victim.write_bytes(b"the victim's weights")
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for name in ("step-00000004.pt", "last.pt", "best.pt", ".last.pt.tmp-1", ".step-00000004.pt.tmp-1"):
        (folder / name).symlink_to(victim)
    saver = checkpoint.CheckpointSaver(folder, keep=2)
    path = saver.save({"model": {"w": torch.ones(2)}, "optimizer": {}, "epoch": 1, "step": 4, "config": {}}, True)
    assert victim.read_bytes() == b"the victim's weights"
    for name in ("step-00000004.pt", "last.pt", "best.pt"):
        assert not (folder / name).is_symlink() and mode(folder / name) == 0o600
    assert checkpoint.load(path)["step"] == 4
    fresh = checkpoint.CheckpointSaver(tmp_path / "new" / "checkpoints", keep=0, share="group")
    fresh.save({"model": {}, "optimizer": {}, "epoch": 1, "step": 4, "config": {}}, False)
    assert mode(tmp_path / "new" / "checkpoints") == 0o750
    assert mode(tmp_path / "new" / "checkpoints" / "last.pt") == 0o640


@pytest.mark.parametrize("share, folder_mode, file_mode", [("private", 0o700, 0o600), ("group", 0o750, 0o640)])
def test_tensorboard_event_files_have_the_runs_mode(tmp_path, umask_022, share, folder_mode, file_mode):
    run = tmp_path / "run"
    for leg, start_step in enumerate((0, 40)):  # a resumed run opens a second event file
        writer = MetricsWriter(run, tensorboard=True, share=share, start_step=start_step)
        writer.write({"split": "train", "epoch": leg, "step": start_step + 20, "loss": 1.0})
        writer.close()
    events = sorted((run / "tb").glob("events.out.tfevents.*"))
    assert len(events) == 2 and events[1].stat().st_size > 0
    assert mode(run / "tb") == folder_mode and [mode(path) for path in events] == [file_mode, file_mode]
