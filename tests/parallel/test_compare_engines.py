"""benchmarks/compare_engines.py at toy size, once: every contender (the Horovod engine, the torch
engine, plain DDP) runs and times the steps and samples asked for, and the summary pairs them."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import BIN, REPO, job_env

pytestmark = pytest.mark.slow  # three 2-rank launches, about 30 s here


def test_compare_engines_times_the_work_it_asked_for(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([str(BIN / "python"), str(REPO / "benchmarks" / "compare_engines.py"), "--rounds", "1",
                             "--steps", "2", "--warmup-steps", "1", "--batch-size", "4", "--image-size", "32",
                             "--out", str(out)], cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "compare_engines.json").read_text())
    assert set(summary["contenders"]) == {"horovod", "torch", "ddp"}
    for name, row in summary["contenders"].items():
        # 2 timed steps x 4 images x 2 ranks, counted by each contender itself
        assert [(run["steps"], run["samples"]) for run in row["runs"]] == [(2, 16)], name
        assert row["median"] > 0
    # The pairing arithmetic is tested with numbers of its own (tests/unit/test_compare_engines.py);
    # here, that each ratio pairs the runs this run timed.
    ratios = summary["ratios"]
    assert set(ratios) == {"torch/horovod", "torch/ddp", "horovod/ddp"}
    rate = {name: row["runs"][0]["images_per_sec"] for name, row in summary["contenders"].items()}
    for pair, ratio in ratios.items():
        top, bottom = pair.split("/")
        assert ratio["paired"] == [pytest.approx(rate[top] / rate[bottom])], pair
