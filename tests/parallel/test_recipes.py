"""Today's recipes on really launched 2-rank jobs (three launches in all):

* everything on (EMA every 2 steps, mixup + cutmix, TrivialAugment, random erasing, progressive
  resizing 32 -> 64 px, LARS with the poly schedule, flip TTA, best.pt by ema_top1) under
  horovodrun: stopped mid-epoch (at 64 px) and resumed == uninterrupted, bitwise, for the
  parameters, the EMA weights and the optimizer state; parameters and EMA equal on both ranks;
  ``hvdtrain evaluate eval.ema=true`` scores the EMA weights as the run did;
* under mpirun, one launch: every preset shrunk to 2 steps of tiny images on 2 ranks (all in one
  process per rank: starting ranks costs more than the steps), then the learning check on the demo
  data with EMA + mixup + TrivialAugment, which stops at train.target_top1 and records the time to
  accuracy; parameters and EMA equal on both ranks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from hvdtrain.tools.report import by_split, load_records, summary_lines
from tests.helpers import BIN, REPO, launch
from tests.unit.test_recipes import RECIPES

RECIPE_PROBE = REPO / "tests" / "parallel" / "recipe_probe.py"

EVERYTHING = ["--config", "debug", "data.workers=1", "checkpoint.every_steps=3", "checkpoint.keep=100",
              "train.epochs=3", "ema.decay=0.9", "ema.every_steps=2", "augment.mixup_alpha=0.2",
              "augment.cutmix_alpha=1.0", "augment.policy=trivialaugment", "augment.random_erase=0.25",
              "data.min_res=32", "data.max_res=64", "data.start_ramp=0", "data.end_ramp=3", "optim.name=lars",
              "optim.base_lr=2.0", "optim.weight_decay=5e-5", "optim.schedule=poly", "optim.warmup_epochs=1",
              "optim.label_smoothing=0.1", "eval.flip=true", "checkpoint.best_metric=ema_top1",
              "output.tensorboard=false", "dist.timeout_seconds=300"]


def assert_bitwise(a, b, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, equal bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys differ"
        for key in a:
            assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a} != {b}"


def ranks(probe: Path) -> list[dict]:
    saved = [torch.load(probe / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for key in ("state", "ema", "optimizer"):
        assert_bitwise(saved[0][key], saved[1][key], f"rank 0 vs rank 1: {key}")
    return saved


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipes_straight")
    result = launch("horovodrun-gloo", 2, [str(RECIPE_PROBE), str(tmp / "probe"), "train"] + EVERYTHING
                    + [f"data.dir={tiny_data}", f"output.dir={tmp / 'run'}"], tmp)
    return tmp, result.stdout, ranks(tmp / "probe")[0]


def test_everything_on_resumes_bitwise_and_ranks_agree(straight, tiny_data, tmp_path):
    tmp, output, expected = straight
    assert expected["step"] == 12 and expected["ema"] is not None
    assert type(expected["optimizer"]["state"][0]["momentum_buffer"]) is torch.Tensor  # LARS's buffers
    records = load_records(tmp / "run")
    val = [r for r in records if r["split"] == "val"]
    assert len(val) == 3 and all("ema_top1" in r and "ema_loss" in r for r in val)
    assert "ema top1" in output and "model EMA, decay 0.9 every 2 step(s)" in output
    # best.pt is the checkpoint of the epoch with the best EMA top-1 (the first such epoch).
    best = torch.load(tmp / "run" / "checkpoints" / "best.pt", weights_only=True)
    assert best["best_metric"] == max(r["ema_top1"] for r in val)
    assert best["step"] == 4 * (1 + [r["ema_top1"] for r in val].index(best["best_metric"]))

    # Resume from the mid-epoch checkpoint at global step 9 (epoch 3, step 1 of 4, at 64 px).
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp / "run" / "checkpoints" / "step-00000009.pt", run_dir / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(RECIPE_PROBE), str(tmp_path / "probe"), "train"] + EVERYTHING
                    + [f"data.dir={tiny_data}", f"output.dir={run_dir}"], tmp_path)
    assert "resumed from" in result.stdout and "epoch 3, step 1/4" in result.stdout
    resumed = ranks(tmp_path / "probe")[0]
    for key in ("state", "ema", "optimizer"):
        assert_bitwise(resumed[key], expected[key], f"resumed vs uninterrupted: {key}")

    # hvdtrain evaluate scores the EMA weights of the last checkpoint exactly as the run did.
    evaluated = launch("single", 1, ["-m", "hvdtrain", "evaluate", "--checkpoint",
                                     str(tmp / "run" / "checkpoints" / "last.pt"), "eval.ema=true",
                                     f"data.dir={tiny_data}"], tmp_path)
    line = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert (line["top1"], line["loss"]) == pytest.approx((val[-1]["ema_top1"], val[-1]["ema_loss"]), rel=1e-6)


def test_presets_run_on_two_ranks_and_the_demo_learns_with_ema_mixup_trivialaugment(tiny_data, tmp_path):
    probe, run_dir = tmp_path / "probe", tmp_path / "learn"
    # 32 px, 15 steps of 2 x 32 images per epoch; measured: EMA top-1 28% after epoch 1, 51.5% after 2.
    learn = ["--config", "demo", "data.image_size=32", "data.workers=0", "runtime.threads=1", "train.epochs=5",
             "optim.base_lr=0.2", "optim.warmup_epochs=1", "ema.decay=0.98", "augment.mixup_alpha=0.2",
             "augment.policy=trivialaugment", "checkpoint.best_metric=ema_top1", "train.target_top1=40",
             "output.progress=false",
             "output.tensorboard=false", "dist.timeout_seconds=300", f"output.dir={run_dir}"]
    result = launch("mpirun", 2, [str(RECIPE_PROBE), str(probe), "presets", str(tiny_data), *RECIPES, "--", *learn],
                    tmp_path)
    presets = [json.loads((probe / f"presets{r}.json").read_text()) for r in range(2)]
    assert presets[0] == presets[1]  # parameters and EMA digests, steps and metrics: identical on both ranks
    optimizers = {name: presets[0][name]["optimizer"] for name in RECIPES}
    assert optimizers["mlperf_lars_rn50"] == "LARS" and optimizers["timm_rsb_a3"] == "LAMB"
    assert all(entry["steps"] == 2 and entry["val"]["samples"] == 21 for entry in presets[0].values())

    saved = ranks(probe)  # the learning run: parameters, EMA and optimizer state equal on both ranks
    records = load_records(run_dir)
    val = [r for r in records if r["split"] == "val"]
    reached = val[-1]
    # Well above chance (10 classes: 10%): the EMA weights reach 40% top-1, and the run stops there.
    assert reached.get("target_reached") and reached["ema_top1"] >= 40, [r["ema_top1"] for r in val]
    assert len(val) < 5 and all(r["ema_top1"] < 40 for r in val[:-1])
    assert reached["epochs_to_target"] == len(val) and saved[0]["step"] == 15 * len(val)
    assert 0 < reached["time_to_target_seconds"] < 600
    assert "target reached: val ema_top1" in result.stdout
    assert any("time to accuracy" in line for line in summary_lines(run_dir, by_split(records)))
    assert BIN.exists()
