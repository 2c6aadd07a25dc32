"""benchmarks/compare.py arithmetic: medians, ratios to the reference contender, weak scaling."""

from __future__ import annotations

import pytest

from benchmarks import compare


def test_medians_ratios_and_weak_scaling():
    summary = compare.summarize({"raw": [10.0, 12.0, 11.0], "hvdtrain-1": [10.5, 10.8, 11.2],
                                 "ddp-2": [20.0, 21.0, 19.0], "hvdtrain-2-gloo": [21.0, 20.5, 22.0]})
    rows = summary["contenders"]
    for row, ranks in zip(rows.values(), (1, 1, 2, 2)):
        row["ranks"] = ranks
    assert rows["raw"]["median"] == 11.0 and (rows["raw"]["min"], rows["raw"]["max"]) == (10.0, 12.0)
    assert rows["hvdtrain-1"]["ratio"] == pytest.approx(10.8 / 11.0) and rows["hvdtrain-1"]["target"] == 0.97
    assert rows["hvdtrain-2-gloo"]["ratio"] == pytest.approx(21.0 / 20.0)
    assert summary["weak_scaling_efficiency"] == {"hvdtrain-2-gloo vs hvdtrain-1": pytest.approx(21.0 / 21.6),
                                                  "ddp-2 vs raw": pytest.approx(20.0 / 22.0)}
    text = "\n".join(compare.table(summary) + compare.markdown(summary))
    assert "0.982 of raw  ok" in text and "1.050 of ddp-2  ok" in text
    assert "| hvdtrain-1 | 1 | 10.80 | 10.50..11.20 | 0.982 of raw (target 0.97: met) |" in text
