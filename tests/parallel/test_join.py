"""``dist.join`` for uneven inputs, under both controllers: the rank with more batches goes on
alone after the other has joined (its allreduces sum without the joined rank), join returns the
rank that joined last, and a broadcast afterwards completes. And on a Horovod built with GPU
operations but no GPU driver, join stops with one line instead of hanging."""

from __future__ import annotations

import json

import horovod.torch as hvd
import pytest
import torch

from hvdtrain.comm import dist
from hvdtrain.config import ConfigError
from tests.helpers import REPO, launch


@pytest.mark.parametrize("kind", ["horovodrun-gloo", "mpirun"])
def test_join_with_uneven_batches(kind, tmp_path):
    result = launch(kind, 2, [str(REPO / "tests" / "parallel" / "join_probe.py")], tmp_path, timeout=120)
    lines = [json.loads(line[line.index("{"):]) for line in result.stdout.splitlines() if '"rank"' in line]
    by_rank = {entry["rank"]: entry for entry in lines}
    # Batches 0 and 1: both ranks (1 + 2); batch 2: rank 0 alone after rank 1 joined.
    assert by_rank[0]["sums"] == [3.0, 3.0, 1.0] and by_rank[1]["sums"] == [3.0, 3.0], lines
    assert by_rank[0]["last"] == by_rank[1]["last"] == 0
    assert by_rank[1]["shared"] == {"from": "rank 0"}


def test_join_on_a_gpu_build_without_a_driver_stops_in_one_line(monkeypatch):
    monkeypatch.setattr(hvd, "nccl_built", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call in (dist.join, dist.refuse_join):
        with pytest.raises(ConfigError) as caught:
            call()
        assert "\n" not in str(caught.value) and "HVDTRAIN_GPU_OPS=none" in str(caught.value)
    monkeypatch.setattr(hvd, "nccl_built", lambda: 0)
    assert dist.join_problem() is None
