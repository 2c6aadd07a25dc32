"""A run whose training goes non-finite stops with one line that names the step, on every rank at
the same step (the verdict comes from the averaged gradients, which every rank shares), before
anything of the diverged state is saved: last.pt stays the last finite checkpoint, best.pt is
never overwritten with NaN weights, and a resume starts from it. Before, optim.base_lr=nan trained
to loss nan and exited 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, example_task_variant, launch

NAN_TASK = '''

class NanTask(TabularTask):
    """The example task, except that rank 1's loss becomes NaN at its training batch number
    HVDTRAIN_TEST_NAN_AT (an overflow on one rank: the allreduce spreads it to every rank)."""

    calls = 0

    def build_loaders(self, env):
        self.rank = env.rank
        return super().build_loaders(env)

    def loss(self, outputs, targets, training):
        loss = super().loss(outputs, targets, training)
        if training:
            self.calls += 1
            if self.rank == 1 and self.calls == int(os.environ.get("HVDTRAIN_TEST_NAN_AT", "0")):
                loss = loss * float("nan")
        return loss
'''


@pytest.fixture(scope="module")
def task_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("nan_task")
    return example_task_variant(folder, "nan_task", NAN_TASK)


def test_a_nan_loss_on_one_rank_stops_every_rank_and_keeps_the_last_finite_checkpoint(task_file, tmp_path):
    run_dir = tmp_path / "run"
    args = ["-m", "hvdtrain", "--config", str(REPO / "examples" / "custom_task" / "config.yaml"),
            f"task={task_file}:NanTask", f"output.dir={run_dir}", "train.epochs=3", "train.steps_per_epoch=6",
            "checkpoint.every_steps=4", "checkpoint.keep=10", "output.progress=false", "runtime.stats_interval=0"]
    # Epoch 2, its 3rd step: global step 9.
    result = launch("horovodrun-gloo", 2, args, tmp_path, check=False, env={"HVDTRAIN_TEST_NAN_AT": "9"})
    output = result.stdout + result.stderr
    lines = [line for line in output.splitlines() if "training diverged" in line]
    assert result.returncode != 0 and len(lines) == 1, output[-3000:]
    assert "the averaged gradients became inf/NaN at global step 9" in lines[0], lines
    assert not [line for line in output.splitlines() if line.startswith("[") and "Traceback" in line], output[-3000:]
    # Saved: epoch 1's end (step 6) and the mid-epoch checkpoint at step 8; nothing at or after step 9.
    checkpoints = run_dir / "checkpoints"
    last = torch.load(checkpoints / "last.pt", weights_only=True)
    assert last["step"] == 8 and sorted(p.name for p in checkpoints.glob("step-*.pt")) == [
        "step-00000004.pt", "step-00000006.pt", "step-00000008.pt"]
    for name in ("last.pt", "best.pt"):
        state = torch.load(checkpoints / name, weights_only=True)["model"]
        assert all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point()), name
    val = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in val if r["split"] == "val"] == [0]
    # The resume starts from the last finite state (the NaN was one bad batch: now it trains on).
    result = launch("horovodrun-gloo", 2, args, tmp_path, check=False)
    assert result.returncode == 0 and "resumed from" in result.stdout and "global step 8" in result.stdout, \
        result.stdout[-3000:]


def test_the_guard_names_the_first_bad_step_and_counts_scaler_skips():
    from hvdtrain.train.guard import FiniteGuard, JobStopped

    model = torch.nn.Linear(3, 2)
    model(torch.ones(1, 3)).sum().backward()
    guard = FiniteGuard(torch.device("cpu"), check_every=5, max_skipped=3)
    guard.after_allreduce(model, step=0)
    guard.check()
    model.bias.grad[0] = float("inf")
    guard.after_allreduce(model, step=6)
    guard.after_allreduce(model, step=7)
    guard.check(step=8)  # not a check step: nothing read
    with pytest.raises(JobStopped, match="became inf/NaN at global step 7"):
        guard.check(step=10)
    skips = FiniteGuard(torch.device("cpu"), check_every=1, max_skipped=3)
    for step, (old, new) in enumerate([(8.0, 4.0), (4.0, 2.0), (2.0, 4.0), (4.0, 2.0), (2.0, 1.0), (1.0, 0.5)]):
        skips.after_scaler_update(torch.tensor(old), torch.tensor(new), step)
        if step < 5:
            skips.check(step)
    with pytest.raises(JobStopped, match="skipped 3 steps in a row from global step 4"):
        skips.check()
