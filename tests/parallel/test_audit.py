"""The cross-rank audit on really launched ranks: a parameter that one rank changes behind the
others' backs is named, with that rank, at the epoch end (horovodrun, Gloo) and at the step that
``runtime.audit_every`` checks (mpirun); the job stops with one line and writes no checkpoint of the
diverged state, or with ``runtime.audit=warn`` says so and finishes. Every other multi-rank test
runs with the audit on (its default), so they also show it raises no false alarm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import REPO, example_task_variant, launch

DIVERGING_TASK = '''

class DivergingTask(TabularTask):
    """The example task, except that rank 1 nudges one weight before its training batch number
    HVDTRAIN_TEST_DIVERGE_AT (a non-deterministic op, or a rank that skipped a step, does the same)."""

    calls = 0

    def build_loaders(self, env):
        self.rank = env.rank
        return super().build_loaders(env)

    def build_model(self):
        self.model = super().build_model()
        return self.model

    def to_device(self, batch, device, dtype):
        if self.model.training:
            self.calls += 1
            if self.rank == 1 and self.calls == int(os.environ["HVDTRAIN_TEST_DIVERGE_AT"]):
                with torch.no_grad():
                    self.model.mlp[3].bias[0] += 1e-3
        return super().to_device(batch, device, dtype)
'''


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("diverging")
    return example_task_variant(folder, "diverging_task", DIVERGING_TASK)


def run(kind: str, task_file: Path, tmp: Path, diverge_at: int, *extra: str):
    args = ["-m", "hvdtrain", "--config", str(REPO / "examples" / "custom_task" / "config.yaml"),
            f"task={task_file}:DivergingTask", f"output.dir={tmp / 'run'}", "train.epochs=2",
            "train.steps_per_epoch=6", "output.progress=false", "runtime.stats_interval=0", *extra]
    return launch(kind, 2, args, tmp, check=False, env={"HVDTRAIN_TEST_DIVERGE_AT": str(diverge_at)})


def audit_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "ranks hold different states" in line]


def test_a_diverged_parameter_is_named_at_the_epoch_end_and_stops_the_job(task_file, tmp_path):
    result = run("horovodrun-gloo", task_file, tmp_path, diverge_at=3)
    output = result.stdout + result.stderr
    lines = audit_lines(output)
    assert result.returncode != 0 and len(lines) == 1, output[-3000:]
    assert "at the end of epoch 1 (global step 6): parameter mlp.3.bias differs on rank(s) 1 from rank 0" in lines[0]
    # No rank prints a traceback (horovodrun's own, after the ranks exit, is the launcher's).
    assert not [line for line in output.splitlines() if line.startswith("[") and "Traceback" in line], output[-3000:]
    # Nothing of the diverged state was saved: no checkpoint, no epoch record.
    assert not list((tmp_path / "run" / "checkpoints").glob("*.pt"))
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()


def test_audit_every_catches_it_at_the_next_audited_step_under_mpirun(task_file, tmp_path):
    result = run("mpirun", task_file, tmp_path, 3, "runtime.audit_every=2")
    lines = audit_lines(result.stdout + result.stderr)
    assert result.returncode != 0 and len(lines) == 1, (result.stdout + result.stderr)[-3000:]
    # Batch 3 is taken before step 3's update: steps 3 and 4 are run on the nudged weight, step 4 audits.
    assert "at global step 4: parameter mlp.3.bias differs on rank(s) 1" in lines[0], lines


def test_warn_mode_says_so_and_finishes(task_file, tmp_path):
    result = run("horovodrun-gloo", task_file, tmp_path, 3, "runtime.audit=warn")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    lines = audit_lines(result.stdout)
    # Both epoch ends and both checkpoints see it (the nudge is never undone).
    assert lines and all("warning" in line and "going on (runtime.audit=warn)" in line for line in lines), lines
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["split"] == "val"] == [0, 1]


def test_no_divergence_no_line(task_file, tmp_path):
    result = run("horovodrun-gloo", task_file, tmp_path, 0, "runtime.audit_every=1", "checkpoint.every_steps=4")
    assert result.returncode == 0 and not audit_lines(result.stdout + result.stderr), result.stdout[-3000:]
