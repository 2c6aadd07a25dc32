"""What a run prints and records about its ranks, at a size no test machine runs: 512 fake ranks on
64 hosts. The 2-rank run that writes the files for real: tests/parallel/test_rank_logs.py."""

from __future__ import annotations

import json
import warnings

import pytest

from hvdtrain.observe import rank_logs
from hvdtrain.observe.metrics import MetricsWriter
from hvdtrain.observe.phases import straggler_line
from hvdtrain.observe.rank_logs import (
    WarningTally,
    host_map,
    rank_ranges,
    read_records,
    split_record,
    straggler_lines,
    summary_lines,
    write_host_map,
)
from hvdtrain.tools.report import load_records

WORLD, PER_HOST = 512, 8


def placement(order: str = "block") -> list[tuple[int, str]]:
    """(rank, host) of 512 ranks on 64 hosts: by block (horovodrun -H, srun's default) or round robin
    (mpirun --map-by node)."""
    hosts = WORLD // PER_HOST
    if order == "block":
        return [(rank, f"node{rank // PER_HOST}") for rank in range(WORLD)]
    return [(rank, f"node{rank % hosts}") for rank in range(WORLD)]


def test_rank_ranges():
    assert rank_ranges([3, 0, 1, 2, 8, 9, 11]) == "0-3,8-9,11"
    assert rank_ranges([5]) == "5"
    assert rank_ranges([]) == ""


def test_host_map_is_ranges_per_host_and_bounded_at_512_ranks():
    line = host_map(placement())
    assert line.startswith("node0: ranks 0-7, node1: ranks 8-15, node2: ranks 16-23, ")
    assert line.endswith(", node14: ranks 112-119, ... 49 more hosts (ranks.tsv)")
    assert len(line) < 400, len(line)  # the old line named 16 ranks and cut the rest
    # Round robin (mpirun --map-by node): no ranges to make; the line stops at about 300 characters.
    spread = host_map(placement("round robin"))
    assert spread.startswith("node0: ranks 0,64,128,192,256,320,384,448, node1: ranks 1,65,")
    assert spread.endswith(", node6: ranks 6,70,134,198,262,326,390,454, ... 57 more hosts (ranks.tsv)"), spread
    assert len(spread) < 400, len(spread)
    assert host_map([(0, "localhost"), (1, "localhost")]) == "localhost: ranks 0-1"
    assert host_map([(0, "a"), (1, "b")]) == "a: rank 0, b: rank 1"


def test_the_full_map_goes_to_a_file(tmp_path):
    rows = [(rank, host, 1000 + rank) for rank, host in placement()]
    path = write_host_map(tmp_path, list(reversed(rows)))
    lines = path.read_text().splitlines()
    assert lines[0] == "rank\thost\tpid"
    assert lines[1:] == [f"{r}\t{h}\t{p}" for r, h, p in rows]  # every rank, in rank order
    # A folder that cannot be written costs the file, not the run.
    assert write_host_map(tmp_path / "missing" / "deeper", rows) is None


def stragglers(count: int) -> list[dict]:
    """``count`` slow ranks, slowest first, as phases.find_stragglers returns them."""
    return [{"rank": 7 * i % WORLD, "host": f"node{7 * i % WORLD // PER_HOST}", "slower": round(2.0 - i / 1000, 4),
             "phase": "data", "phase_fraction": 0.5} for i in range(count)]


def test_stragglers_are_the_worst_five_and_a_count():
    found = stragglers(300)
    lines = straggler_lines(found, 0.15, WORLD, straggler_line)
    assert len(lines) == 6
    assert lines[:5] == [straggler_line(s) for s in found[:5]]
    assert lines[0] == ("hvdtrain: straggler: rank 0 on node0 is 200% slower than the median rank: "
                        "data wait 50% of its step")
    assert lines[5].startswith("hvdtrain: stragglers: 295 more rank(s) of 512 over 15% slower than the median "
                               "(up to 200%), on ")
    assert lines[5].endswith(" hosts: every one in metrics_ranks.jsonl")
    assert straggler_lines(found[:3], 0.15, WORLD, straggler_line) == [straggler_line(s) for s in found[:3]]
    assert straggler_lines([], 0.15, WORLD, straggler_line) == []


def train_record(world: int, slow: int) -> dict:
    by_rank = [{"rank": r, "host": f"node{r // PER_HOST}", "busy_ms_per_step": 123.456, "data": 0.1, "compute": 0.6,
                "allreduce": 0.2, "optimizer": 0.05, "other": 0.05, "cpu_percent": 97.5, "rss_gib": 2.3456,
                "workers_count": 8, "workers_cpu_percent": 512.25} for r in range(world)]
    record = {"split": "train", "epoch": 3, "step": 400, "loss": 2.5, "samples": 1281167, "lr": 0.4,
              "phase_data": 0.1, "busy_ms_per_step": 123.4, "by_rank": by_rank}
    if slow:
        record["stragglers"] = stragglers(slow)
    return record


def test_metrics_jsonl_stays_small_at_512_ranks_and_reads_back_whole(tmp_path):
    record = train_record(WORLD, slow=40)
    writer = MetricsWriter(tmp_path, tensorboard=False)
    writer.write(record)
    writer.write({"split": "val", "epoch": 3, "step": 400, "loss": 2.0, "top1": 50.0})
    writer.close()
    small = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "by_rank" not in small[0] and small[0]["stragglers_total"] == 40 and len(small[0]["stragglers"]) == 5
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()[0]) < 1500  # was 150 KB at 512 ranks
    detail = [json.loads(line) for line in (tmp_path / "metrics_ranks.jsonl").read_text().splitlines()]
    assert len(detail) == 1 and len(detail[0]["by_rank"]) == WORLD and len(detail[0]["stragglers"]) == 40
    assert (detail[0]["split"], detail[0]["epoch"], detail[0]["step"]) == ("train", 3, 400)
    # Readers get the record back as it was: hvdtrain report, the tests' helper.
    joined = read_records(tmp_path)
    assert joined[0]["by_rank"] == record["by_rank"] and joined[0]["stragglers"] == record["stragglers"]
    assert joined[1] == {"split": "val", "epoch": 3, "step": 400, "loss": 2.0, "top1": 50.0}
    assert load_records(tmp_path)[0]["stragglers"] == record["stragglers"]


def test_an_old_run_folder_with_per_rank_detail_inline_reads_the_same(tmp_path):
    record = train_record(4, slow=2)
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    assert read_records(tmp_path) == [record]
    assert load_records(tmp_path) == [record]


def test_a_record_without_per_rank_detail_is_written_whole():
    record = {"split": "val", "epoch": 0, "step": 4, "loss": 1.0}
    assert split_record(record) == (record, None)


def test_a_warning_every_rank_raises_is_said_once_with_its_count():
    message = "This DataLoader will create 2 worker processes in total. Our suggested max number of worker is 1"
    tallies, shown = [], []
    for rank in range(WORLD):
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            tally = WarningTally(speak=rank == 0)
            tally.original = lambda message, *where: shown.append(str(message))  # Python's printer
            tally.install()
            for _ in range(2):  # the train and the val loader
                warnings.warn_explicit(message, UserWarning, "torch/utils/data/dataloader.py", 627)
        tallies.append(tally.take())
    assert shown == [message]  # rank 0's first, as it came; 1,023 others kept back
    said: set[str] = set()
    lines = summary_lines(tallies, said, epoch=0)
    assert lines == [f"hvdtrain: warning from 512 of 512 rank(s), 1024 time(s) in epoch 1 (said once): "
                     f"UserWarning: {message}"]
    assert summary_lines(tallies, said, epoch=1) == []  # said once per run


def test_warning_summary_counts_ranks_and_skips_rank_0s_single_warning():
    tallies = [{"UserWarning: only rank 0": 1}, {"UserWarning: a few ranks": 3}, {}, {"UserWarning: a few ranks": 1}]
    assert summary_lines(tallies, set(), epoch=4) == [
        "hvdtrain: warning from 2 of 4 rank(s), 4 time(s) in epoch 5 (said once): UserWarning: a few ranks"]


def test_a_process_counts_a_bounded_number_of_distinct_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("default")
        tally = WarningTally(speak=False).install()
        for index in range(rank_logs.WARNINGS_KEPT + 10):
            warnings.warn_explicit(f"file {index} is odd", UserWarning, "lib.py", index)
        tally.uninstall()
        assert warnings.showwarning is tally.original
    counts = tally.take()
    assert len(counts) == rank_logs.WARNINGS_KEPT + 1 and counts["(other warnings)"] == 10


@pytest.mark.parametrize("world", [1, 2, 512])
def test_split_keeps_every_figure_but_the_per_rank_lists(world):
    record = train_record(world, slow=world // 2)
    small, detail = split_record(record)
    assert {k: v for k, v in record.items() if k not in ("by_rank", "stragglers")} == \
        {k: v for k, v in small.items() if k not in ("stragglers", "stragglers_total")}
    assert detail["by_rank"] == record["by_rank"]
