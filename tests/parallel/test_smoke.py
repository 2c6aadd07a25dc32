"""The launched smoke test of `make test-fast`: 2 ranks train with mid-epoch checkpoints, a second
job resumes from one of them, and the two end bitwise equal, with identical parameters on both
ranks and every validation image counted once. The full suite proves each part in depth
(test_training.py, test_fault_tolerance.py); this is the one launched check of the edit-run loop."""

from __future__ import annotations

import shutil

import pytest

from tests.helpers import PROBE, assert_bitwise_equal, final_states, launch, read_metrics, tiny

pytestmark = pytest.mark.smoke


def test_train_checkpoint_resume_and_compare(tiny_data, tmp_path):
    common = ["checkpoint.every_steps=3", "checkpoint.keep=10", "output.tensorboard=false"]
    straight = tmp_path / "straight"
    launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe")] + tiny(tiny_data, straight, *common), tmp_path)
    states = final_states(tmp_path / "probe")
    assert_bitwise_equal(states[0], states[1])
    records = read_metrics(straight)
    assert [(r["split"], r["epoch"], r["samples"]) for r in records] == [
        ("train", 0, 64), ("val", 0, 21), ("train", 1, 64), ("val", 1, 21)]

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copy(straight / "checkpoints" / "step-00000003.pt", resumed / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe2")] + tiny(tiny_data, resumed, *common),
                    tmp_path)
    assert "resumed from" in result.stdout and "at epoch 1, step 3/4" in result.stdout, result.stdout[-2000:]
    assert_bitwise_equal(final_states(tmp_path / "probe2")[0], states[0])
