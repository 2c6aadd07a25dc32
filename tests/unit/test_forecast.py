"""The scaling forecast (hvdtrain/observe/forecast.py) with numbers worked by hand, and the lines
``hvdtrain bench --link-gbit`` prints from it (hvdtrain/tools/bench.py)."""

from __future__ import annotations

import pytest

from hvdtrain.config import ConfigError
from hvdtrain.observe.forecast import (
    GBIT,
    forecast,
    format_forecast,
    link_for_compute_bound,
    ring_allreduce_seconds,
    scaling_limit,
)
from hvdtrain.tools.bench import add_forecast, cmd_bench, format_report

# A measured case: resnet18 (11,689,512 parameters: 46,758,048 bytes of fp32 gradients), one node
# at 15.17 img/s with 16 images a step (T = 16 / 15.17 = 1.0547 s), over a link measured at
# 241 Mbit/s (B = 30.125 MB/s). Two nodes: T_comm = 2 x 1/2 x G / B = 46.758 / 30.125 = 1.5521 s,
# so the limit is 1.0547 / 1.5521 = 0.6795; fp16 halves it to 0.7761 s < T: limit 1.
RESNET18_BYTES = 11_689_512 * 4
STEP = 16 / 15.17
LINK = 241e6 / 8


def test_ring_allreduce_time_is_two_n_minus_one_over_n_of_the_bytes_over_the_bandwidth():
    assert ring_allreduce_seconds(1, 1e6, 1e6) == 0  # one node: nothing to send
    assert ring_allreduce_seconds(2, 1e6, 1e6) == pytest.approx(1.0)  # 2 x 1/2
    assert ring_allreduce_seconds(4, 1e6, 1e6) == pytest.approx(1.5)  # 2 x 3/4
    assert ring_allreduce_seconds(32, 8e6, 2e6) == pytest.approx(2 * 31 / 32 * 4)
    assert ring_allreduce_seconds(2, RESNET18_BYTES, LINK) == pytest.approx(1.55213, abs=1e-5)


def test_the_measured_resnet18_case_is_link_bound_at_0_68_in_fp32_and_compute_bound_in_fp16():
    assert STEP == pytest.approx(1.05471, abs=1e-5)
    assert scaling_limit(STEP, RESNET18_BYTES, LINK, 2) == pytest.approx(0.6795, abs=1e-4)
    assert scaling_limit(STEP, RESNET18_BYTES / 2, LINK, 2) == 1.0
    table = forecast(STEP, RESNET18_BYTES, LINK)
    assert [p.nodes for p in table["fp32"]] == [2, 4, 8, 16, 32]
    # T / (2(N-1)/N x 1.5521 s): 1.0547 / 2.3282, / 2.7162, / 2.9102, / 3.0072
    assert [round(p.factor, 3) for p in table["fp32"]] == [0.680, 0.453, 0.388, 0.362, 0.351]
    assert {p.bottleneck for p in table["fp32"]} == {"link"}
    # fp16: T_comm = 0.7761, 1.1641, 1.3581, 1.4551, 1.5036 s
    assert [round(p.factor, 3) for p in table["fp16"]] == [1.0, 0.906, 0.777, 0.725, 0.701]
    assert [p.bottleneck for p in table["fp16"]] == ["compute", "link", "link", "link", "link"]
    # no node count is link-bound from B = 2G/T = 88.67 MB/s = 0.709 Gbit/s (fp32) on
    assert link_for_compute_bound(STEP, RESNET18_BYTES) / GBIT == pytest.approx(0.7093, abs=1e-4)
    assert {p.bottleneck for p in forecast(STEP, RESNET18_BYTES, 0.71 * GBIT)["fp32"]} == {"compute"}


def test_a_fast_link_is_compute_bound_at_every_node_count():
    # 1 s step, 100 MB of gradients, 10 Gbit/s = 1.25 GB/s: T_comm(32) = 1.9375 x 0.08 s = 0.155 s
    table = forecast(1.0, 100e6, 10 * GBIT)
    assert all(p.factor == 1.0 and p.bottleneck == "compute" for points in table.values() for p in points)
    assert table["fp32"][-1].comm_seconds == pytest.approx(0.155)


@pytest.mark.parametrize("args, problem", [((0, 1e6, 1e6, 2), "step time"), ((1, 1e6, 0, 2), "bandwidth"),
                                           ((1, 1e6, 1e6, 0), "nodes")])
def test_impossible_inputs_are_refused_with_what_is_wrong(args, problem):
    with pytest.raises(ValueError, match=problem):
        scaling_limit(*args)


def test_the_printed_forecast_names_inputs_factors_and_bottleneck():
    lines = format_forecast(STEP, RESNET18_BYTES, LINK)
    assert lines == [
        "forecast: scaling limit over a 0.241 Gbit/s link: step 1.055 s on one node, 46.8 MB of fp32 gradients, "
        "ring allreduce fully overlapped with backward (an upper bound)",
        "forecast: nodes       2      4      8     16     32",
        "forecast: fp32     0.68   0.45   0.39   0.36   0.35",
        "forecast: fp16     1.00   0.91   0.78   0.72   0.70",
        "forecast: bottleneck, fp32: the link from 2 nodes on",
        "forecast: bottleneck, fp16: compute up to 2 nodes, the link from 4 on",
        "forecast: compute-bound at any node count from 0.709 Gbit/s (fp32) or 0.355 Gbit/s (fp16) between hosts",
    ]
    fast = format_forecast(1.0, 100e6, 10 * GBIT)
    assert fast[4] == "forecast: bottleneck, fp32: compute at every node count up to 32"


def bench_result(world_size: int = 1) -> dict:
    return {"arch": "resnet18", "image_size": 112, "batch_size": 16, "backward_passes_per_step": 1,
            "world_size": world_size, "controller": "gloo", "device": "cpu", "threads_per_rank": 1,
            "compression": "none", "amp": "off", "compile": False, "warmup_steps": 5, "repeats": 5, "steps": 20,
            "per_rank": [{"rank": 0, "images_per_sec": 15.17, "ci95": 0.1}], "images_per_sec": 15.17, "ci95": 0.1,
            "step_seconds": STEP, "gradient_bytes": RESNET18_BYTES}


def test_bench_prints_the_forecast_from_its_step_and_gradients_before_its_last_line():
    result = bench_result()
    result.update(add_forecast(result, 0.241))
    lines = format_report(result)
    assert lines[-1] == "images_per_sec=15.17"
    printed = [line for line in lines if line.startswith("bench: ")][-7:]
    assert printed == ["bench: " + line for line in format_forecast(STEP, RESNET18_BYTES, LINK, prefix="")]
    assert printed[2] == "bench: fp32     0.68   0.45   0.39   0.36   0.35"
    assert result["link_gbit"] == 0.241
    assert result["forecast_table"]["fp16"][0] == {"nodes": 2, "factor": 1.0, "comm_seconds": pytest.approx(0.77607,
                                                   abs=1e-5), "bottleneck": "compute"}
    assert not any("forecast" in line or "Gbit" in line for line in format_report(bench_result()))  # not asked


def test_bench_says_when_its_step_time_holds_its_own_communication():
    result = bench_result(world_size=2)
    lines = add_forecast(result, 1.0)["forecast"]
    assert lines[-1] == ("the step time is that of this run's 2 ranks, their own communication included: "
                         "run bench on one node's ranks for that node's step")


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bench_refuses_a_link_without_bandwidth(value):
    with pytest.raises(ConfigError, match=rf"^--link-gbit must be > 0 \(the bandwidth between hosts in Gbit/s\), "
                                          rf"got {float(value)}$"):
        cmd_bench(["--link-gbit", value])
