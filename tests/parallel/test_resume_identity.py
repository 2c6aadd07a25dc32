"""A resume never mixes two runs (really launched, 2 ranks): a checkpoint trained with another
learning rate or another model is refused in one line naming each key with both values, and
nothing in the run folder changes; keys that may change between legs of a run (epochs) resume and
say so; checkpoint.resume=force continues through a difference and records it in metrics.jsonl; a
checkpoint whose model does not fit is named, tensors and shapes, never a traceback."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import launch, tiny


def folder_digest(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def train(tiny_data: Path, run_dir: Path, tmp: Path, *extra: str):
    return launch("horovodrun-gloo", 2, ["-m", "hvdtrain"] + tiny(tiny_data, run_dir, "train.epochs=1",
                                                                  "output.tensorboard=false", *extra),
                  tmp, check=False)


def error_lines(result) -> list[str]:
    return [line for line in (result.stdout + result.stderr).splitlines() if "hvdtrain: error" in line]


@pytest.fixture(scope="module")
def trained_once(tiny_data, tmp_path_factory) -> Path:
    """One finished 1-epoch run for the whole module (a launch costs 4-5 s here, about 2.4x that in
    CI), kept as a copy beside the folder the tests resume."""
    tmp = tmp_path_factory.mktemp("trained")
    assert train(tiny_data, tmp / "run", tmp).returncode == 0
    shutil.copytree(tmp / "run", tmp / "finished")
    return tmp


@pytest.fixture()
def trained(trained_once) -> Path:
    """That run, as it finished, at the path it was trained in (output.dir is part of the stored
    config: a copy elsewhere would resume as a changed setting); the module's tests take turns."""
    run_dir = trained_once / "run"
    shutil.rmtree(run_dir)
    shutil.copytree(trained_once / "finished", run_dir)
    return run_dir


@pytest.mark.parametrize("change, named", [("optim.base_lr=0.2", "optim.base_lr=0.4 (now 0.2)"),
                                           ("model.arch=resnet34", "model.arch='resnet18' (now 'resnet34')")])
def test_a_checkpoint_of_another_run_is_refused_and_nothing_is_written(trained, tiny_data, tmp_path, change, named):
    before = folder_digest(trained)
    result = train(tiny_data, trained, tmp_path, change, "train.epochs=2")
    lines = error_lines(result)
    assert result.returncode != 0 and lines, result.stdout[-2000:] + result.stderr[-2000:]
    assert "belongs to another run" in lines[0] and named in lines[0] and "checkpoint.resume=force" in lines[0]
    assert "train.epochs" not in lines[0]  # a key that may change is not a reason to refuse
    output = (result.stdout + result.stderr).splitlines()
    assert not [line for line in output if line.startswith("[") and "Traceback" in line]
    assert folder_digest(trained) == before  # checkpoints, config.yaml and metrics.jsonl untouched


def test_more_epochs_resume_and_say_so(trained, tiny_data, tmp_path):
    result = train(tiny_data, trained, tmp_path, "train.epochs=2")
    assert result.returncode == 0 and "with changed settings: train.epochs=1 (now 2)" in result.stdout
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in records if r["split"] == "resume"]
    assert resume["forced"] == [] and resume["changed"] == {"train.epochs": [1, 2]}
    assert [r["epoch"] for r in records if r["split"] == "val"] == [0, 1]


def test_force_continues_through_a_difference_and_records_it(trained, tiny_data, tmp_path):
    result = train(tiny_data, trained, tmp_path, "optim.base_lr=0.2", "train.epochs=2", "checkpoint.resume=force")
    assert result.returncode == 0 and "resumed from" in result.stdout, result.stdout[-2000:]
    records = [json.loads(line) for line in (trained / "metrics.jsonl").read_text().splitlines()]
    (resume,) = [r for r in records if r["split"] == "resume"]
    assert resume["forced"] == ["optim.base_lr"] and resume["changed"]["optim.base_lr"] == [0.4, 0.2]


def test_a_model_that_does_not_fit_is_named_in_one_line(trained, tiny_data, tmp_path):
    result = train(tiny_data, trained, tmp_path, "model.arch=resnet34", "train.epochs=2", "checkpoint.resume=force")
    lines = error_lines(result)
    assert result.returncode != 0 and lines and "does not fit this model" in lines[0], result.stderr[-2000:]
    assert "unknown to this model" in lines[0] or "missing" in lines[0]
    output = (result.stdout + result.stderr).splitlines()
    assert not [line for line in output if line.startswith("[") and "Traceback" in line]
