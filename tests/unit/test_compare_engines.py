"""benchmarks/compare_engines.py's arithmetic: ratios paired round by round, and the rotated order."""

from __future__ import annotations

import pytest

from benchmarks import compare_engines


def _runs(rates: list[float]) -> list[dict]:
    return [{"images_per_sec": rate, "steps": 2, "samples": 16} for rate in rates]


def test_ratios_are_paired_round_by_round_not_taken_of_the_medians():
    # Round 2 ran on a machine twice as busy for both: pairing cancels it, a ratio of medians does not.
    summary = compare_engines.summarize({"horovod": _runs([10.0, 40.0, 20.0]), "torch": _runs([11.0, 100.0, 21.0]),
                                         "ddp": _runs([10.0, 50.0, 20.0])})
    torch_horovod = summary["ratios"]["torch/horovod"]
    assert torch_horovod["paired"] == pytest.approx([1.1, 2.5, 1.05])
    assert torch_horovod["paired_median"] == pytest.approx(1.1)
    medians = summary["contenders"]
    assert medians["torch"]["median"] / medians["horovod"]["median"] == pytest.approx(1.05)  # not what is reported
    assert summary["ratios"]["horovod/ddp"]["paired"] == pytest.approx([1.0, 0.8, 1.0])
    assert (medians["torch"]["min"], medians["torch"]["max"]) == (11.0, 100.0)


def test_each_contender_takes_each_place_equally_often():
    names = ["horovod", "torch", "ddp"]
    orders = [compare_engines.round_order(names, r) for r in range(6)]
    assert orders[:3] == [["horovod", "torch", "ddp"], ["torch", "ddp", "horovod"], ["ddp", "horovod", "torch"]]
    for place in range(3):
        assert sorted(order[place] for order in orders) == sorted(names * 2)
