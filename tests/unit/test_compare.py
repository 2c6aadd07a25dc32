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
    # Paired: run i against the reference's run i, so drift between rounds cancels; the verdict is on
    # their median (hvdtrain-1: 1.05, 0.9 and 1.018 -> 1.018, met, where the ratio of medians is 0.982).
    assert rows["hvdtrain-1"]["paired_ratios"] == pytest.approx([10.5 / 10, 10.8 / 12, 11.2 / 11])
    assert rows["hvdtrain-1"]["paired"] == pytest.approx(11.2 / 11)
    gloo = [21 / 20, 20.5 / 21, 22 / 19]
    assert rows["hvdtrain-2-gloo"]["paired_mean"] == pytest.approx(sum(gloo) / 3)
    spread = (sum((g - sum(gloo) / 3) ** 2 for g in gloo) / 2) ** 0.5
    assert rows["hvdtrain-2-gloo"]["paired_ci95"] == pytest.approx(4.303 * spread / 3 ** 0.5)
    assert summary["weak_scaling_efficiency"] == {"hvdtrain-2-gloo vs hvdtrain-1": pytest.approx(21.0 / 21.6),
                                                  "ddp-2 vs raw": pytest.approx(20.0 / 22.0)}
    text = "\n".join(compare.table(summary) + compare.markdown(summary))
    assert "0.982 of raw; paired 1.018, 0.989 +- 0.196  ok" in text and "1.050 of ddp-2; paired 1.050, 1.061" in text
    assert "| hvdtrain-1 | 1 | 10.80 | 10.50..11.20 | 0.982 of raw | 1.018, 0.989 +- 0.196 (target 0.97: met) |" in text
    below = compare.summarize({"ddp-2": [20.0, 20.0, 20.0], "hvdtrain-2-mpi": [19.0, 21.0, 19.5]})
    below["contenders"]["ddp-2"]["ranks"] = below["contenders"]["hvdtrain-2-mpi"]["ranks"] = 2
    assert "BELOW target 1.0" in "\n".join(compare.table(below))
    assert "(target 1.0: not met)" in "\n".join(compare.markdown(below))
