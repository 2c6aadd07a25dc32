"""What a real 2-rank job writes about its ranks (the formatting at 512 ranks:
tests/unit/test_rank_logs.py): the host map as ranges and in full in ranks.tsv, metrics.jsonl
without the per-rank part, which goes to metrics_ranks.jsonl, and a warning every rank raises
printed once, then said once with its count."""

from __future__ import annotations

import json
import re

from tests.helpers import launch, read_metrics, tiny

DATALOADER_WARNING = "This DataLoader will create 2 worker processes in total"


def test_two_ranks_write_the_host_map_and_per_rank_detail_apart_and_say_a_warning_once(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    # runtime.cpu_affinity=rank gives each rank one core of this 2-core machine, and 2 loader workers
    # on one core make PyTorch's DataLoader warn on every rank: the per-rank third-party warning.
    result = launch("horovodrun-gloo", 2, ["-m", "hvdtrain"] + tiny(tiny_data, run_dir, "data.workers=2",
                                                                    "runtime.cpu_affinity=rank"), tmp_path)
    out = result.stdout + result.stderr
    assert re.search(r"hvdtrain: 2 ranks on 1 host\(s\) .*; localhost: ranks 0-1$", result.stdout, re.M), out
    rows = (run_dir / "ranks.tsv").read_text().splitlines()
    assert rows[0] == "rank\thost\tpid" and [row.split("\t")[:2] for row in rows[1:]] == [["0", "localhost"],
                                                                                          ["1", "localhost"]]
    assert len({int(row.split("\t")[2]) for row in rows[1:]}) == 2
    # metrics.jsonl: the epoch's figures only; metrics_ranks.jsonl: each train epoch's rows per rank.
    small = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["split"] for r in small] == ["train", "val", "train", "val"]
    assert not any("by_rank" in r for r in small) and all("phase_compute" in r for r in small if r["split"] == "train")
    detail = [json.loads(line) for line in (run_dir / "metrics_ranks.jsonl").read_text().splitlines()]
    assert [(d["split"], d["epoch"]) for d in detail] == [("train", 0), ("train", 1)]
    assert all([row["rank"] for row in d["by_rank"]] == [0, 1] for d in detail)
    joined = [r for r in read_metrics(run_dir) if r["split"] == "train"]
    assert [row["host"] for r in joined for row in r["by_rank"]] == ["localhost"] * 4
    # The warning: Python's own print once (rank 0's), then one line with the count of ranks.
    assert out.count(DATALOADER_WARNING) == 2, out
    said = [line for line in out.splitlines() if "hvdtrain: warning from " in line]  # horovodrun adds [0]<stdout>:
    assert len(said) == 1 and re.search(r"hvdtrain: warning from 2 of 2 rank\(s\), \d+ time\(s\) in epoch 1 "
                                        rf"\(said once\): UserWarning: {DATALOADER_WARNING}", said[0]), said
