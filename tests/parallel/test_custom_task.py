"""A task of the user's own, from a folder outside the repository (examples/custom_task copied to a
temporary folder), trained by really launched jobs: by ``task: path.py:Class`` under horovodrun and
through the Python API under mpirun (identical parameters on every rank), exact validation with 3
ranks over 101 rows, a mid-epoch resume bitwise equal to the uninterrupted run, and one-line errors
for a task that lacks a method and a task file that does not import."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import BIN, PROBE, REPO, job_env, launch, wait_for_line

EXAMPLE = REPO / "examples" / "custom_task"
TASK = "elsewhere/tabular_task.py:TabularTask"  # relative to the jobs' working directory


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A working directory outside the repository with the example in elsewhere/."""
    root = tmp_path_factory.mktemp("custom_task")
    assert REPO not in root.parents
    shutil.copytree(EXAMPLE, root / "elsewhere", ignore=shutil.ignore_patterns("__pycache__", "runs"))
    return root


def cli_args(work: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(work / "elsewhere" / "config.yaml"), f"task={TASK}", f"data.dir={work / 'rows'}",
            f"output.dir={run_dir}", "train.epochs=2", *extra]


def final_states(probe_dir: Path) -> list[dict]:
    return [torch.load(probe_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert different == [], f"{len(different)} tensors differ, e.g. {different[:3]}"


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def straight(work) -> tuple[Path, dict]:
    """The uninterrupted run (horovodrun, Gloo): 600 rows / (2 ranks x 16) = 18 steps per epoch,
    a mid-epoch checkpoint at step 5."""
    run_dir = work / "straight"
    launch("horovodrun-gloo", 2, [str(PROBE), str(work / "probe-straight")]
           + cli_args(work, run_dir, "checkpoint.every_steps=5", "checkpoint.keep=100"), work)
    ranks = final_states(work / "probe-straight")
    assert [(r["rank"], r["size"], r["controller"]) for r in ranks] == [(0, 2, "gloo"), (1, 2, "gloo")]
    return run_dir, ranks


def test_a_task_from_a_file_trains_on_two_ranks_with_identical_parameters(straight):
    run_dir, ranks = straight
    assert_bitwise_equal(ranks[0]["state"], ranks[1]["state"])
    assert ranks[0]["step"] == ranks[1]["step"] == 2 * 18
    records = read_metrics(run_dir)
    assert [(r["split"], r["epoch"], r["samples"]) for r in records] == [
        ("train", 0, 576), ("val", 0, 101), ("train", 1, 576), ("val", 1, 101)]
    assert records[-1]["accuracy"] > 60.0  # 3 classes: chance is 33%
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert saved["task"] == {"name": "tabular", "hidden": 32, "numeric": 8, "levels": 4, "classes": 3}
    assert saved["config"]["task"] == TASK
    # The task's own settings (its section, named after it) are recorded in checkpoints and config.yaml.
    assert saved["config"]["tabular"] == {"hidden": 32, "noise": 0.05}
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["tabular"] == {"hidden": 32, "noise": 0.05}


def test_mid_epoch_resume_is_bitwise_identical(straight, work):
    # Resumed with a loader worker per rank (the uninterrupted run loaded in-process): the worker
    # imports the task's file by its stable module name, and per-sample seeding makes the
    # augmentation independent of where rows are loaded.
    straight_dir, expected = straight
    run_dir = work / "resumed"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(straight_dir / "checkpoints" / "step-00000005.pt", run_dir / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(work / "probe-resumed")]
                    + cli_args(work, run_dir, "data.workers=1"), work)
    assert "at epoch 1, step 5/18 (global step 5)" in result.stdout
    resumed = final_states(work / "probe-resumed")
    assert_bitwise_equal(resumed[0]["state"], resumed[1]["state"])
    assert_bitwise_equal(resumed[0]["state"], expected[0]["state"])


def test_the_python_api_stops_on_sigterm_and_resumes_under_mpirun(work):
    # examples/custom_task/train.py: hvdtrain.fit(TabularTask, config.yaml, overrides),
    # then hvdtrain.evaluate of the last checkpoint on the same ranks. First one process, stopped by
    # SIGTERM in its second epoch: a checkpoint and exit 75, as python -m hvdtrain does.
    # 4 epochs of 30 steps of a few milliseconds: the stop agreement (about every 0.5 s of steps, read
    # at the latest at an epoch's end) sees a SIGTERM sent after epoch 1's line in epoch 2 or 3; with
    # 2 epochs it could be seen only once the run had finished (exit 0, once in a fresh-clone run).
    program = [str(work / "elsewhere" / "train.py"), f"data.dir={work / 'rows'}", f"output.dir={work / 'api'}",
               "train.epochs=4"]
    job = subprocess.Popen([str(BIN / "python")] + program, cwd=work, env=job_env(work), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        lines = wait_for_line(job, "epoch 1/4 ")
        job.send_signal(signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    assert job.returncode == 75, "".join(lines) + rest
    assert re.search(r"stopped by SIGTERM in epoch [23]/4 ", rest), rest
    # Then 2 ranks under mpirun continue from that checkpoint (written by 1 rank) to the end.
    result = launch("mpirun", 2, program, work)
    assert "resumed from" in result.stdout and "written by 1 ranks, this job has 2" in result.stdout
    lines = [json.loads(line[line.index("{"):]) for line in result.stdout.splitlines() if '{"rank"' in line]
    assert sorted((line["rank"], line["size"]) for line in lines) == [(0, 2), (1, 2)]
    assert lines[0]["params"] == lines[1]["params"]
    for line in lines:
        assert line["fit_val"]["samples"] == line["evaluate"]["samples"] == 101
        assert line["evaluate"]["accuracy"] == line["fit_val"]["accuracy"]
        assert line["evaluate"]["loss"] == pytest.approx(line["fit_val"]["loss"], rel=1e-12)
    # The class handed to fit() is recorded by module:Class, where the next process finds it.
    saved = torch.load(work / "api" / "checkpoints" / "last.pt", weights_only=True)
    assert saved["config"]["task"] == "tabular_task:TabularTask"


def test_validation_on_three_ranks_counts_every_row_once(work):
    # 101 validation rows over 3 ranks: shards of 34, 34 and 33, no padding.
    run_dir = work / "three"
    launch("horovodrun-gloo", 3, ["-m", "hvdtrain"] + cli_args(work, run_dir, "train.epochs=1"), work)
    val = [r for r in read_metrics(run_dir) if r["split"] == "val"][-1]
    train = [r for r in read_metrics(run_dir) if r["split"] == "train"][-1]
    assert (val["samples"], train["samples"]) == (101, 12 * 3 * 16)
    # The same checkpoint scored here, in one process, row by row.
    from hvdtrain.config import from_dict
    from hvdtrain.job_config import validate
    from hvdtrain.tasks import task_class

    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    # A recorded config imports nothing until the task it names is named here (tasks.checkpoint_task).
    cfg = from_dict(saved["config"], stored=True)
    cfg.task = str(work / TASK)
    validate(cfg)
    assert cfg.tabular.hidden == 32
    task = task_class(cfg.task)(cfg)
    model = task.build_model()
    model.load_state_dict(saved["model"])
    model.eval()
    rows = sys.modules[type(task).__module__].Rows(work / "rows" / "val.csv")  # the example's CSV reader
    with torch.no_grad():
        logits = model((rows.numeric, rows.category))
    correct = int((logits.argmax(1) == rows.label).sum())
    loss = float(torch.nn.functional.cross_entropy(logits, rows.label, reduction="sum")) / len(rows)
    assert val["accuracy"] == 100.0 * correct / 101
    assert val["loss"] == pytest.approx(loss, rel=1e-5)


INCOMPLETE = '''
from hvdtrain import Task

class Incomplete(Task):
    sum_fields = ("count",)
    def build_loaders(self, env): ...
    def build_model(self): ...
    def to_device(self, batch, device, dtype): ...
    def loss(self, outputs, targets, training): ...
'''


def test_a_task_that_lacks_a_method_or_does_not_import_stops_with_one_line(tmp_path):
    (tmp_path / "incomplete.py").write_text(INCOMPLETE)
    (tmp_path / "broken.py").write_text("import no_such_package\n")
    env = job_env(tmp_path)
    # Through the CLI (the task loads after Horovod starts) and through the API (before).
    cli = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "task=broken.py:Broken"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    api = subprocess.run([str(BIN / "python"), "-c", "import hvdtrain; hvdtrain.fit('incomplete.py:Incomplete')"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert (cli.returncode, api.returncode) == (2, 2)
    assert cli.stderr.splitlines() == [
        "hvdtrain: error: config key 'task': cannot import broken.py "
        "(ModuleNotFoundError: No module named 'no_such_package')"]
    assert api.stderr.splitlines() == [
        "hvdtrain: error: task 'incomplete.py:Incomplete' lacks metric_sums, summarize "
        "(the task interface: docs/tasks.md)"]
