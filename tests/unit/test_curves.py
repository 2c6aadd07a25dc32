"""Curves per step: TensorBoard gets the step-level training loss, metric, rate and throughput every
tracking.every_steps steps and the epoch records at the global step of each epoch's end, so that a
resumed run's legs join up (points a crashed leg wrote past its checkpoint are purged); read back
with TensorBoard's own EventAccumulator. The progress line shows the epoch's running loss and
metric, every output.progress_every_steps steps (main.py's --print-freq)."""

from __future__ import annotations

import types

import pytest
import torch

from hvdtrain.job_config import load_config
from hvdtrain.observe.metrics import MetricSums, MetricsWriter, StepCurves
from hvdtrain.tasks.image_classification import summarize
from hvdtrain.train.trainer import Progress
from tests.helpers import tb_scalars


def batch_sums(loss: float, correct: int, count: int = 4) -> torch.Tensor:
    """One batch's row of the image task's sums: loss x count, top-1 hits, top-5 hits, count."""
    return torch.tensor([loss * count, correct, count, count], dtype=torch.float64)


def leg(run_dir, start: int, end: int, steps_per_epoch: int = 4, every: int = 2) -> None:
    """Train steps start+1 .. end as the loop does: the writer opened at the resumed step, the curves
    reset at each epoch's start, an epoch record at each epoch's end; batch s has loss s."""
    writer = MetricsWriter(run_dir, tensorboard=True, start_step=start)
    curves = StepCurves(every, writer)
    sums = MetricSums(4)
    curves.start_epoch(start, sums)
    for step in range(start + 1, end + 1):
        sums.add(batch_sums(float(step), correct=step % 5))
        curves.after_step(step, sums, summarize, lr=0.1 / step, global_batch=8)
        if step % steps_per_epoch == 0:
            writer.write({"split": "train", "epoch": step // steps_per_epoch - 1, "step": step, "loss": float(step),
                          "stopped": False})
            writer.write({"split": "val", "epoch": step // steps_per_epoch - 1, "step": step, "top1": 10.0 * step,
                          "target_reached": False})
            sums = MetricSums(4)
            curves.start_epoch(step, sums)
    writer.close()


def test_step_points_and_epoch_records_share_the_global_step(tmp_path):
    leg(tmp_path, 0, 8)
    scalars = tb_scalars(tmp_path)
    # Every 2 steps: the mean over rank 0's batches since the last point (losses 1, 2 -> 1.5; 3, 4 -> 3.5).
    assert scalars["train_step/loss"] == [(2, 1.5), (4, 3.5), (6, 5.5), (8, 7.5)]
    assert scalars["train_step/top1"] == [(2, 37.5), (4, 87.5), (6, 12.5), (8, 62.5)]
    assert [step for step, _ in scalars["train_step/lr"]] == [2, 4, 6, 8]
    assert [value for _, value in scalars["train_step/lr"]] == pytest.approx([0.1 / s for s in (2, 4, 6, 8)])
    assert [step for step, _ in scalars["train_step/samples_per_sec"]] == [2, 4, 6, 8]
    assert scalars["val/top1"] == [(4, 40.0), (8, 80.0)] and scalars["epoch"] == [(4, 1.0), (8, 2.0)]
    assert "train/stopped" not in scalars and "val/target_reached" not in scalars  # no flags as curves


def test_a_resumed_run_joins_up_and_hides_what_a_crashed_leg_wrote_past_its_checkpoint(tmp_path):
    leg(tmp_path, 0, 7)   # crashed after step 7; its last checkpoint was the end of epoch 1 (step 4)
    leg(tmp_path, 4, 12)  # resumed from step 4: steps 5-7 trained again, with the same values here
    scalars = tb_scalars(tmp_path)
    assert [step for step, _ in scalars["train_step/loss"]] == [2, 4, 6, 8, 10, 12]  # no step twice
    assert [step for step, _ in scalars["val/top1"]] == [4, 8, 12]
    assert scalars["epoch"] == [(4, 1.0), (8, 2.0), (12, 3.0)]


def test_no_step_points_with_tracking_every_steps_0(tmp_path):
    leg(tmp_path, 0, 4, every=0)
    scalars = tb_scalars(tmp_path)
    assert not any(tag.startswith("train_step/") for tag in scalars) and scalars["val/top1"] == [(4, 40.0)]


def fake_run(lr: float = 0.1) -> types.SimpleNamespace:
    return types.SimpleNamespace(settings=types.SimpleNamespace(current_lr=lambda state: lr), state=None)


def test_the_progress_line_every_n_steps_shows_the_running_loss_and_top1(capsys):
    from hvdtrain.tasks.image_classification import ImageClassification

    task = ImageClassification(load_config(None, ["data.synthetic=true"]))
    sums = MetricSums(4)
    progress = Progress(0, 90, 23, every=10, sums=sums, task=task)
    for step in range(23):
        sums.add(batch_sums(2.0, correct=1))
        progress.update(fake_run(), step)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[1].split()[1] for line in lines] == ["10/23", "20/23"]
    assert lines[0].startswith("epoch 1/90: step 10/23 (43%), ") and "lr 0.1, " in lines[0]
    assert lines[0].endswith("loss 2, top1 25 (rank 0, this epoch)")


def test_the_default_progress_line_shows_them_too(capsys):
    from hvdtrain.tasks.image_classification import ImageClassification

    task = ImageClassification(load_config(None, ["data.synthetic=true"]))
    sums = MetricSums(4)
    progress = Progress(0, 90, 20, sums=sums, task=task)
    progress.last_line -= 60  # as if the last line were a minute old: the 10 s limit is met
    sums.add(batch_sums(1.5, correct=2))
    progress.update(fake_run(), 1)  # step 2 of 20: the first 10%
    assert capsys.readouterr().out.strip().endswith("loss 1.5, top1 50 (rank 0, this epoch)")
