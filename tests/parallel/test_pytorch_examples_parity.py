"""benchmarks/pytorch_examples_parity.py at toy size (1 epoch, 1 seed, 16 px crops): both contenders
ran, and ran the same work: main.py's recipe keeps the last partial batch, so 1,437 digits on 2
ranks at a global batch of 64 are 23 steps of both, 1,438 samples (one padded, as
DistributedSampler pads), and every one of the 360 validation images once. Nothing is timed."""

from __future__ import annotations

import importlib.util
import math

from tests.helpers import REPO


def test_the_parity_benchmark_runs_the_same_work_on_both_sides(tmp_path):
    spec = importlib.util.spec_from_file_location("parity", REPO / "benchmarks" / "pytorch_examples_parity.py")
    parity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parity)
    result = parity.main(["--seeds", "0", "--epochs", "1", "--image-size", "16", "--work", str(tmp_path),
                          "--json", str(tmp_path / "result.json")])
    per_rank = math.ceil(1437 / 2)
    for name in ("ddp", "hvdtrain"):
        (epoch,) = result["curves"][name]["0"]
        assert epoch["steps"] == math.ceil(per_rank / 32) == 23, (name, epoch)
        assert epoch["train_samples"] == 2 * per_rank == 1438, (name, epoch)
        assert epoch["val_samples"] == 360, (name, epoch)
        assert epoch["lr"] == 0.02 and 0 <= epoch["val_top1"] <= 100
    assert (tmp_path / "result.json").is_file()
