"""data.decoder=nvimgcodec on really launched ranks, through nvImageCodec's CPU backend (no GPU
here; on a GPU the same code decodes on the device): identical parameters on 2 ranks, the same
validation on 1, 2 and 3 ranks (every image once), a mid-epoch resume bitwise equal to the
uninterrupted run, and a messy dataset's bad files counted as on the CPU path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import PROBE, assert_bitwise_equal, final_states, launch, read_metrics
from tests.parallel.test_bad_files import messy_dataset

pytest.importorskip("nvidia.nvimgcodec", reason="the gpudecode extra (nvImageCodec) is not installed")

# Augmentation on (random-resized crops and flips planned by the workers), a worker per rank,
# checkpoints every 3 steps with 4 steps per epoch: at steps 3, 4, 6, 8.
DEVICE = ["--config", "debug", "data.decoder=nvimgcodec", "data.workers=1", "checkpoint.every_steps=3",
          "checkpoint.keep=100", "train.epochs=2", "output.tensorboard=false"]


def args(data: Path, run_dir: Path, *extra: str) -> list[str]:
    return DEVICE + [f"data.dir={data}", f"output.dir={run_dir}", *extra]


@pytest.fixture(scope="module")
def straight(tiny_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("device_straight")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp / "probe")] + args(tiny_data, tmp / "run"), tmp)
    assert "JPEG decoding: nvImageCodec on the CPU backend" in result.stdout
    states = final_states(tmp / "probe")
    assert_bitwise_equal(states[0], states[1])
    return tmp / "run", states[0]


def test_two_ranks_train_to_identical_parameters_and_validate_every_image_once(straight):
    run_dir, _ = straight
    records = read_metrics(run_dir)
    assert [r["samples"] for r in records if r["split"] == "val"] == [21, 21]   # 21 val images, odd
    assert [r["samples"] for r in records if r["split"] == "train"] == [64, 64]  # 4 steps x 2 ranks x 8


@pytest.mark.slow
def test_one_two_and_three_ranks_validate_alike(straight, tmp_path):
    run_dir, _ = straight
    checkpoint = str(run_dir / "checkpoints" / "last.pt")
    found = []
    for kind, ranks in (("single", 1), ("horovodrun-gloo", 2), ("mpirun", 3)):
        result = launch(kind, ranks, ["-m", "hvdtrain", "evaluate", "--checkpoint", checkpoint], tmp_path)
        found.append(json.loads(next(line[line.index("{"):] for line in result.stdout.splitlines() if "{" in line)))
    assert [m["samples"] for m in found] == [21, 21, 21]
    assert len({m["top1"] for m in found}) == 1 and len({m["top5"] for m in found}) == 1
    assert max(m["loss"] for m in found) - min(m["loss"] for m in found) < 1e-5


def test_a_mid_epoch_resume_is_bitwise_identical(straight, tiny_data, tmp_path):
    straight_dir, expected = straight
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    shutil.copy(straight_dir / "checkpoints" / "step-00000003.pt", run_dir / "checkpoints" / "last.pt")
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe")] + args(tiny_data, run_dir), tmp_path)
    assert "resumed from" in result.stdout and "step 3/4" in result.stdout
    states = final_states(tmp_path / "probe")
    assert_bitwise_equal(states[0], states[1])
    assert_bitwise_equal(states[0], expected)


def test_bad_files_are_counted_as_on_the_cpu_path(tmp_path):
    data = tmp_path / "data"
    messy_dataset(data)
    counts = {}
    for decoder in ("cpu", "nvimgcodec"):
        run_dir = tmp_path / decoder
        launch("horovodrun-gloo", 2, ["-m", "hvdtrain", "--config", "debug", f"data.dir={data}",
                                      f"output.dir={run_dir}", f"data.decoder={decoder}", "train.steps_per_epoch=0",
                                      "data.max_bad_fraction=0.2", "output.tensorboard=false"], tmp_path)
        records = read_metrics(run_dir)
        counts[decoder] = [(r["split"], r["samples"], r["bad_files"]) for r in records]
    assert counts["nvimgcodec"] == counts["cpu"] == [("train", 32, 4), ("val", 12, 2)] * 2
