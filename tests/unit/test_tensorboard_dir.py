"""output.tensorboard_dir: the event files where the team's dashboards look, held to the rules of the
run folder's tb/ (the user's own folder that nobody else can write or swap, files 0600 or 0640, no
write through a link), checked with the run folder before any rank trains; and
output.tensorboard_tags=horovod_example: Horovod's example's four epoch curves, read back with
TensorBoard's own reader."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from hvdtrain.config import ConfigError
from hvdtrain.job_config import load_config
from hvdtrain.observe.metrics import MetricsWriter, tensorboard_folder
from hvdtrain.train.run_folder import output_dir_problem
from tests import users
from tests.helpers import tb_scalars


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def two_epochs(writer: MetricsWriter) -> None:
    """The records of two epochs of 4 steps, as the loop writes them (top1 in percent)."""
    for epoch, (loss, top1, val_loss, val_top1) in enumerate([(2.5, 20.0, 2.25, 25.0), (1.5, 60.0, 1.25, 62.5)]):
        step = 4 * (epoch + 1)
        writer.write({"split": "train", "epoch": epoch, "step": step, "loss": loss, "top1": top1, "lr": 0.1,
                      "stopped": False})
        writer.write({"split": "val", "epoch": epoch, "step": step, "loss": val_loss, "top1": val_top1, "top5": 99.0,
                      "samples": 360})
    writer.close()


@pytest.mark.parametrize("share, folder_mode, file_mode", [("private", 0o700, 0o600), ("group", 0o750, 0o640)])
def test_event_files_go_to_the_named_folder_with_the_runs_modes(tmp_path, umask_022, share, folder_mode, file_mode):
    run, dashboards = tmp_path / "run", tmp_path / "team" / "tb" / "resnet50-a"
    folder = tensorboard_folder(run, str(dashboards))
    assert folder == dashboards and tensorboard_folder(run, "") == run / "tb"
    two_epochs(MetricsWriter(run, tensorboard=True, share=share, tb_dir=folder))
    assert not (run / "tb").exists()
    events = sorted(dashboards.glob("events.out.tfevents.*"))
    assert len(events) == 1 and mode(dashboards) == folder_mode and mode(events[0]) == file_mode
    scalars = tb_scalars(run, dashboards)
    assert scalars["val/top1"] == [(4, 25.0), (8, 62.5)] and scalars["epoch"] == [(4, 1.0), (8, 2.0)]


def test_the_examples_tags_are_its_four_curves_per_epoch_as_fractions(tmp_path):
    """Horovod's example: log_writer.add_scalar('train/loss' | 'train/accuracy' | 'val/loss' |
    'val/accuracy', value, epoch), accuracy a fraction, epoch 0-based (its lines 92-93, 117-118)."""
    two_epochs(MetricsWriter(tmp_path, tensorboard=True, tags="horovod_example"))
    scalars = tb_scalars(tmp_path)
    assert sorted(scalars) == ["train/accuracy", "train/loss", "val/accuracy", "val/loss"]
    assert scalars["train/loss"] == [(0, 2.5), (1, 1.5)] and scalars["val/loss"] == [(0, 2.25), (1, 1.25)]
    assert scalars["train/accuracy"] == [(0, pytest.approx(0.2)), (1, pytest.approx(0.6))]
    assert scalars["val/accuracy"] == [(0, pytest.approx(0.25)), (1, pytest.approx(0.625))]
    # hvdtrain's own names keep their x axis, the global step, and the percentage.
    two_epochs(MetricsWriter(tmp_path / "own", tensorboard=True))
    assert tb_scalars(tmp_path / "own")["train/top1"] == [(4, 20.0), (8, 60.0)]


def test_a_folder_others_can_write_is_refused_with_the_run_folder_in_one_line(tmp_path):
    run, dashboards = tmp_path / "run", tmp_path / "open"
    dashboards.mkdir()
    dashboards.chmod(0o777)
    problem = output_dir_problem(run, tensorboard=dashboards)
    assert problem.startswith(f"the tensorboard folder '{dashboards}' is not safe to write into: {dashboards} can be "
                              f"written by anyone") and "output.tensorboard_dir=/a/folder/of/yours" in problem
    assert "\n" not in problem
    assert output_dir_problem(run, tensorboard=tmp_path / "mine" / "tb") is None
    assert mode(tmp_path / "mine" / "tb") == 0o700  # made as tb/ is


def test_a_dashboard_folder_another_user_planted_or_linked_is_never_written(victim_scratch, tmp_path):
    folder, home = victim_scratch
    # Her folder where the victim's dashboards would be, with a link where an event file could land,
    # and a link of hers to the victim's own folder.
    users.as_user(users.ATTACKER, f"mkdir -m 777 dash && ln -s {home}/notes.txt dash/events.out.tfevents.1 && "
                                  f"ln -s {home} link", cwd=folder)
    for target, words in ((folder / "dash", f"{folder / 'dash'} belongs to {users.ATTACKER}"),
                          (folder / "link" / "tb", f"{folder / 'link'} is a link that {users.ATTACKER} owns")):
        problem = output_dir_problem(tmp_path / "run", tensorboard=target)
        assert problem is not None and words in problem and "\n" not in problem, problem
        with pytest.raises(ValueError, match="is not safe to write into"):
            MetricsWriter(tmp_path / "run", tensorboard=True, tb_dir=target)
    users.untouched(home)  # nothing written through her link, no tb/ made in the folder it names


@pytest.mark.parametrize("overrides", [["output.tensorboard=false", "output.tensorboard_dir=/team/tb/a"],
                                       ["output.tensorboard=false", "output.tensorboard_tags=horovod_example"]])
def test_the_folder_and_tags_need_tensorboard_on(overrides):
    with pytest.raises(ConfigError) as error:
        load_config("debug", overrides)
    assert str(error.value) == "output.tensorboard_dir and output.tensorboard_tags need output.tensorboard=true"
    with pytest.raises(ConfigError, match="output.tensorboard_tags"):
        load_config("debug", ["output.tensorboard_tags=horovod"])
