"""A job Horovod's example started, continued by hvdtrain on 2 ranks (horovodrun --gloo): the
example's checkpoint-2.pth.tar (a resnet18 with the example's SGD after two steps, saved as its
save_checkpoint saves) resumes at epoch 3 with the rate of epoch 3, writes Horovod's example's
TensorBoard tags into output.tensorboard_dir, and `hvdtrain evaluate` scores the file."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torchvision import models

from tests.helpers import launch, read_metrics, tb_scalars

SMALL = ["model.arch=resnet18", "data.image_size=32", "data.val_resize=36", "data.workers=0", "runtime.threads=1",
         "output.progress=false"]


def test_two_ranks_continue_the_examples_checkpoint_and_evaluate_it(tiny_data, tmp_path):
    torch.manual_seed(0)
    model = models.resnet18(num_classes=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0125, momentum=0.9, weight_decay=5e-5)
    for seed in (1, 2):
        generator = torch.Generator().manual_seed(seed)
        optimizer.zero_grad()
        images, labels = torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 4, (8,), generator=generator)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()
    path = tmp_path / "checkpoint-2.pth.tar"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)

    run_dir, dashboards = tmp_path / "run", tmp_path / "dashboards" / "moved"
    result = launch("horovodrun-gloo", 2, ["-m", "hvdtrain", "--config", "horovod_example", f"data.dir={tiny_data}",
                                           f"output.dir={run_dir}", *SMALL, "train.batch_size=8",
                                           "train.steps_per_epoch=4", "train.epochs=3", f"checkpoint.resume={path}",
                                           f"output.tensorboard_dir={dashboards}",
                                           "output.tensorboard_tags=horovod_example"], tmp_path)
    assert f"resumed from {path} (Horovod's example's, after 2 epochs) at epoch 3 (global step 8)" in result.stdout
    assert f"; TensorBoard in {dashboards}" in result.stdout
    records = read_metrics(run_dir)
    assert [(r["split"], r["epoch"]) for r in records] == [("train", 2), ("val", 2)]
    # The warm-up's rate at epoch 3 of 5 (0.0125 per rank, 2 ranks: 0.0125 -> 0.025): its last step is
    # 11 of 20, 0.0125 x (1 + 11 / 20); from epoch 1 it would be at most 0.0125 x (1 + 3 / 20).
    assert records[0]["lr"] == pytest.approx(0.0125 * (1 + 11 / 20))
    saved = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert (saved["epoch"], saved["step"]) == (3, 12)
    scalars = tb_scalars(run_dir, dashboards)
    epoch_tags = {tag for tag in scalars if not tag.startswith("train_step/")}
    assert epoch_tags == {"train/accuracy", "train/loss", "val/accuracy", "val/loss"}, sorted(scalars)
    assert scalars["val/accuracy"] == [(2, pytest.approx(records[1]["top1"] / 100))]
    assert scalars["train/loss"] == [(2, pytest.approx(records[0]["loss"]))]
    assert not (run_dir / "tb").exists()

    scored = launch("horovodrun-gloo", 2, ["-m", "hvdtrain", "evaluate", "--checkpoint", str(path),
                                           f"data.dir={tiny_data}", *SMALL], tmp_path)
    line = [text for text in scored.stdout.splitlines() if '{"' in text][-1]
    metrics = json.loads(line[line.index("{"):])
    assert metrics["samples"] == 21 and 0 <= metrics["top1"] <= 100
    assert f"evaluating {path} (Horovod's example's, after 2 epochs): the model after 2 epochs" in scored.stdout
