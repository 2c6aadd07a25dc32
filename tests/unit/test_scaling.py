"""benchmarks/scaling.py's arithmetic and commands, without running anything: the scaling factor
paired per round, the limit from each contender's own step, failures in one line each, and the
argv each contender runs on one and two nodes."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import scaling
from tests.multinode.netns import NetNodes

RESNET18_BYTES = 11_689_512 * 4
LINK = 241e6 / 8


def args(**changes) -> argparse.Namespace:
    values = dict(arch="resnet18", image_size=112, batch_size=16, warmup_steps=3, steps=10,
                  horovod_script=scaling.Path("/peers/pytorch_synthetic_benchmark.py"))
    return argparse.Namespace(**{**values, **changes})


def test_rates_are_gbit_and_unlimited_and_anything_else_is_refused():
    assert scaling.parse_rates("0.25,1, 4,unlimited") == [0.25, 1.0, 4.0, None]
    for bad in ("fast", "-1"):
        with pytest.raises(SystemExit, match=rf"--rates: '{bad}' is not a rate in Gbit/s"):
            scaling.parse_rates(bad)


def run(one: float, two: float, round_: int) -> dict:
    return {"round": round_, "one": {"images_per_sec": one}, "two": {"images_per_sec": two}}


def test_the_factor_is_paired_per_round_and_set_against_the_limit_of_its_own_step():
    runs = {
        # the measured case of docs/benchmarks.md: 15.17 img/s on one node, 13.13 on two
        "hvdtrain-horovod": [run(15.17, 13.13, 1), run(15.0, 13.5, 2), run(15.5, 12.0, 3)],
        "hvdtrain-horovod-fp16": [run(15.17, 25.78, 1)],
        "ddp": [run(16.0, 16.0, 1), {"round": 2, "one": {"images_per_sec": 16.0}, "two": {"error": "exit 1: boom"}}],
        "ddp-fp16": [{"round": 1, "one": {"error": "timed out after 600s"}, "two": {"images_per_sec": 1.0}}],
    }
    summary = scaling.summarize_rate(runs, LINK, RESNET18_BYTES, 16)
    row = summary["contenders"]["hvdtrain-horovod"]
    # per round: 13.13 / 30.34 = 0.4328, 13.5 / 30 = 0.45, 12 / 31 = 0.3871; median 0.4328
    assert row["factors"] == pytest.approx([0.43276, 0.45, 0.38710], abs=1e-5)
    assert row["factor"] == pytest.approx(0.43276, abs=1e-5)
    assert row["one_node"] == 15.17 and row["two_nodes"] == 13.13 and row["rounds"] == 3
    # T = 16 / 15.17 = 1.0547 s; 2-node ring allreduce 46.758 MB / 30.125 MB/s = 1.5521 s: limit 0.6795
    assert row["limit"] == pytest.approx(0.6795, abs=1e-4)
    assert row["share"] == pytest.approx(0.43276 / 0.6795, abs=1e-3)
    fp16 = summary["contenders"]["hvdtrain-horovod-fp16"]
    assert fp16["limit"] == 1.0 and fp16["factor"] == pytest.approx(0.8497, abs=1e-4)  # halved bytes: 0.776 s < T
    ddp = summary["contenders"]["ddp"]
    assert ddp["factors"] == [0.5] and ddp["errors"] == ["round 2, 2 nodes: exit 1: boom"]
    failed = summary["contenders"]["ddp-fp16"]
    assert "factor" not in failed and failed["errors"] == ["round 1, 1 node: timed out after 600s"]
    assert summary["limit"] == {"reference": "hvdtrain-horovod", "step_seconds": pytest.approx(16 / 15.17),
                                "fp32": pytest.approx(0.6795, abs=1e-4), "fp16": 1.0}


def test_the_markdown_has_a_row_per_contender_a_line_per_failure_and_the_forecast_check():
    runs = {"hvdtrain-horovod": [run(15.17, 13.13, 1)],
            "ddp-fp16": [{"round": 1, "one": {"images_per_sec": 16.0}, "two": {"error": "exit 1: boom"}}]}
    rate = scaling.summarize_rate(runs, LINK, RESNET18_BYTES, 16)
    rate.update(rate="0.25 Gbit/s", link_gbit=0.241, measured_mbit={"node0->node1": 241.0, "node1->node0": 242.0})
    lines = scaling.markdown({"settings_line": "resnet18 112px", "gradient_bytes": RESNET18_BYTES, "load": [1.0, 2.0],
                              "rates": [rate]})
    assert "### Link 0.25 Gbit/s: measured 241 Mbit/s (node0->node1 241, node1->node0 242)" in lines
    assert "| hvdtrain-horovod | 15.17 | 13.13 | 0.433 (0.433) | 0.680 | 0.637 |" in lines
    assert "| ddp-fp16 | failed | | | | |" in lines
    assert "- ddp-fp16 failed at 0.25 Gbit/s, round 1, 2 nodes: exit 1: boom" in lines
    assert "| 0.25 Gbit/s | hvdtrain-horovod | 0.680 | 0.433 | 0.637 | no |" in lines


def test_horovods_synthetic_benchmark_is_read_from_its_own_lines():
    output = ("Model: resnet18\nBatch size: 16\nNumber of CPUs: 2\nRunning warmup...\nRunning benchmark...\n"
              "Iter #0: 7.1 img/sec per CPU\nImg/sec per CPU: 7.1 +-0.0\nTotal img/sec on 2 CPU(s): 14.2 +-0.0\n")
    found = scaling.parse("horovod-synthetic", scaling.Path("/nonexistent"), output, args())
    assert found == {"images_per_sec": 14.2, "steps": 10, "samples": 10 * 16 * 2}
    prefixed = "".join(f"[0]<stdout>:{line}\n" for line in output.splitlines())  # horovodrun's, 2 iterations
    prefixed = prefixed.replace("[0]<stdout>:Iter #0: 7.1 img/sec per CPU", "[0]<stdout>:Iter #0: 7.1 img/sec per CPU\n"
                                "[0]<stdout>:Iter #1: 7.1 img/sec per CPU")
    assert scaling.parse("horovod-synthetic", scaling.Path("/nonexistent"), prefixed, args())["steps"] == 20
    with pytest.raises(ValueError, match="no 'Total img/sec' line"):
        scaling.parse("horovod-synthetic", scaling.Path("/nonexistent"), "Iter #0: 7.1 img/sec per CPU\n", args())


def test_each_contender_runs_one_process_on_one_node_and_spans_both_nodes_on_two(tmp_path):
    nodes, result = NetNodes(tmp_path), tmp_path / "result.json"
    for name in scaling.CONTENDERS:
        one = scaling.commands(name, 1, args(), result, nodes, 47101)
        assert len(one) == 1 and "-H" not in one[0] and "--nnodes" not in one[0], name
        two = scaling.commands(name, 2, args(), result, nodes, 47101)
        if name in ("hvdtrain-torch", "ddp", "ddp-fp16"):
            assert [argv[argv.index("--node_rank") + 1] for argv in two] == ["0", "1"], name
            assert all(argv[argv.index("--master_addr") + 1:argv.index("--master_port") + 2]
                       == ["node0", "--master_port", "47101"] for argv in two)
        else:
            assert len(two) == 1 and two[0][two[0].index("-H") + 1] == "node0:1,node1:1", name
            assert "--network-interfaces" in two[0] and "eth0" in two[0]
    fp16 = scaling.commands("hvdtrain-horovod-fp16", 2, args(), result, nodes, 1)[0]
    assert "dist.compression=fp16" in fp16 and "model.arch=resnet18" in fp16 and "data.image_size=112" in fp16
    assert "dist.compression=fp16" not in scaling.commands("hvdtrain-horovod", 2, args(), result, nodes, 1)[0]
    assert all("--fp16-hook" in argv for argv in scaling.commands("ddp-fp16", 2, args(), result, nodes, 1))
    assert "--fp16-hook" not in scaling.commands("ddp-fp16", 1, args(), result, nodes, 1)[0]  # no DDP on one
    assert "dist.engine=torch" in scaling.commands("hvdtrain-torch", 1, args(), result, nodes, 1)[0]
    synthetic = scaling.commands("horovod-synthetic", 1, args(), result, nodes, 1)[0]
    assert synthetic[1:4] == ["/peers/pytorch_synthetic_benchmark.py", "--no-cuda", "--model"]


def test_the_plot_is_written_with_a_line_per_contender_and_the_limits(tmp_path):
    rates = []
    for gbit, two in ((0.241, 13.13), (0.95, 25.0)):
        rate = scaling.summarize_rate({"hvdtrain-horovod": [run(15.17, two, 1)], "ddp": [run(16.0, 20.0, 1)]},
                                      gbit * 1e9 / 8, RESNET18_BYTES, 16)
        rates.append({**rate, "rate": f"{gbit} Gbit/s", "link_gbit": gbit})
    path = tmp_path / "scaling.png"
    scaling.chart({"settings_line": "resnet18 112px", "contenders": ["hvdtrain-horovod", "ddp"], "rates": rates,
                   "gradient_bytes": RESNET18_BYTES}, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
