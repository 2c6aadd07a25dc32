"""A checkpoint's config never runs code.

``hvdtrain evaluate --checkpoint X`` and ``hvdtrain.evaluate(X)`` build the run from the config
stored in X. Its ``task`` may name ``file.py:Class`` or ``module:Class``, which used to be
imported: whoever handed a colleague a checkpoint ran code as that colleague. Here a checkpoint
that passes the ``weights_only=True`` load names a file that writes a marker when imported; the
marker must never appear, and the person evaluating names the task instead (checked against the
recorded one).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from hvdtrain import cli
from hvdtrain.api import checkpoint_config
from hvdtrain.config import Config, ConfigError, to_dict

TASK_SOURCE = '''
import torch
from hvdtrain import Task

class {name}(Task):
    sum_fields = ("count",)
    def build_loaders(self, env): ...
    def build_model(self): return torch.nn.Linear(2, 2)
    def to_device(self, batch, device, dtype): ...
    def loss(self, outputs, targets, training): ...
    def metric_sums(self, loss, outputs, targets): ...
    def summarize(self, sums): ...
'''


def write_checkpoint(path: Path, task: str, arch: str = "resnet18") -> Path:
    cfg = Config()
    cfg.task = task
    cfg.model.arch = arch
    cfg.data.synthetic = True
    torch.save({"model": {}, "optimizer": {}, "epoch": 0, "step": 0, "format": 3, "config": to_dict(cfg)}, path)
    return path


@pytest.fixture
def hostile(tmp_path) -> tuple[Path, Path]:
    """(a checkpoint whose task is a file in a 'shared folder', the marker that file writes when imported)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    marker = tmp_path / "ran.txt"
    (shared / "evil_task.py").write_text(
        f"import os\nopen({str(marker)!r}, 'w').write(str(os.getuid()))\n" + TASK_SOURCE.format(name="Evil"))
    return write_checkpoint(tmp_path / "last.pt", f"{shared / 'evil_task.py'}:Evil"), marker


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_cli_evaluate_does_not_import_the_checkpoints_task(hostile, capsys):
    checkpoint, marker = hostile
    assert cli.main(["evaluate", "--checkpoint", str(checkpoint)]) == 2
    assert not marker.exists(), "the checkpoint's task file ran"
    line = one_error_line(capsys)
    assert line.startswith(f"hvdtrain: error: checkpoint '{checkpoint}' was written by task '")
    assert "not built in" in line and "--task my_task.py:MyTask" in line


def test_api_evaluate_does_not_import_the_checkpoints_task(hostile, capsys):
    import hvdtrain

    checkpoint, marker = hostile
    with pytest.raises(SystemExit) as stop:
        hvdtrain.evaluate(checkpoint)
    assert stop.value.code == 2
    assert not marker.exists(), "the checkpoint's task file ran"
    assert "task=MyTask" in one_error_line(capsys)


def test_a_task_named_by_the_user_is_checked_against_the_recorded_one(hostile, tmp_path, capsys):
    checkpoint, marker = hostile
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "good_task.py").write_text(TASK_SOURCE.format(name="Good"))
    assert cli.main(["evaluate", "--checkpoint", str(checkpoint), "--task", f"{mine / 'good_task.py'}:Good"]) == 2
    assert not marker.exists()
    line = one_error_line(capsys)
    assert "(class Evil), but the task named here is" in line and "(class Good)" in line
    # A built-in task does not fit a checkpoint of another class either.
    with pytest.raises(ConfigError, match=r"class Evil\), but the task named here is image_classification"):
        checkpoint_config(checkpoint, task="image_classification")
    assert not marker.exists()


def test_the_users_own_copy_of_the_recorded_class_evaluates(tmp_path):
    # Recorded where the training ran; named by the user from wherever their copy is now.
    checkpoint = write_checkpoint(tmp_path / "last.pt", "/gone/elsewhere/tabular.py:Tabular")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "my_tabular.py").write_text(TASK_SOURCE.format(name="Tabular")
                                        + "\nclass Wider(Tabular):\n    pass\n")
    named = f"{mine / 'my_tabular.py'}:Tabular"
    assert checkpoint_config(checkpoint, task=named).task == named
    assert checkpoint_config(checkpoint, [f"task={named}", "train.batch_size=8"]).task == named  # task=... override
    assert checkpoint_config(checkpoint, {"task": named}).task == named
    assert checkpoint_config(checkpoint, task=f"{mine / 'my_tabular.py'}:Wider").task.endswith(":Wider")  # subclass


def test_built_in_tasks_and_classes_handed_over_in_this_process_need_no_name(tmp_path):
    from hvdtrain.tasks import provide

    assert checkpoint_config(write_checkpoint(tmp_path / "a.pt", "image_classification")).task == \
        "image_classification"
    recommendation = write_checkpoint(tmp_path / "b.pt", "recommendation", arch="mf")
    assert checkpoint_config(recommendation).task == "recommendation"
    with pytest.raises(ConfigError, match=r"written by task 'recommendation' \(class Recommendation\)"):
        checkpoint_config(recommendation, task="image_classification")
    namespace: dict = {}
    exec(textwrap.dedent(TASK_SOURCE.format(name="Handed")), namespace)  # a class of the running program
    name = provide(namespace["Handed"])  # what fit(Handed) does
    assert checkpoint_config(write_checkpoint(tmp_path / "c.pt", name)).task == name


def test_a_recorded_name_prints_as_one_line(tmp_path, capsys):
    checkpoint = write_checkpoint(tmp_path / "last.pt", "x.py:Evil\n\x1b[2Jhvdtrain: all good")
    assert cli.main(["evaluate", "--checkpoint", str(checkpoint)]) == 2
    assert "'x.py:Evil??[2Jhvdtrain: all good'" in one_error_line(capsys)


@pytest.mark.parametrize("arch", ["os:system", "subprocess.run", "timm/hf-hub:someone/model",
                                  "timm/local-dir:/tmp/model", "torch.hub:load"])
def test_model_arch_from_a_checkpoint_reaches_no_import(arch):
    # model.arch names an entry of torchvision's or timm's registry, nothing else.
    from hvdtrain.config import ModelConfig
    from hvdtrain.model.build import build_model

    with pytest.raises(ConfigError, match="config key 'model.arch': unknown (torchvision|timm) model"):
        build_model(ModelConfig(arch=arch), num_classes=10)
