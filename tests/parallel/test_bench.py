"""``hvdtrain bench`` really runs the trainer's step, alone and under a 2-rank launcher, and prints
the promised lines."""

from __future__ import annotations

import json
import re

import pytest

from hvdtrain.observe.forecast import format_forecast
from tests.helpers import launch

TINY = ["--warmup-steps", "1", "--steps", "2", "--repeats", "2", "--config", "debug", "train.batch_size=4"]


def result_lines(stdout: str) -> list[str]:
    """Output lines without the launcher's rank prefixes ("[0]<stdout>:", "[1,0]<stdout>:")."""
    return [re.sub(r"^\[[\d,]+\]<stdout>:", "", line) for line in stdout.splitlines()]


def check(stdout: str, ranks: int, json_path, passes: int = 1) -> dict:
    lines = [line for line in result_lines(stdout) if line.strip()]
    assert re.fullmatch(r"images_per_sec=\d+\.\d+", lines[-1].strip()), stdout[-2000:]
    for rank in range(ranks):
        rate = rf"bench: rank {rank}: \d+\.\d+ img/s \+- \d+\.\d+ \(95% interval\)"
        assert any(re.match(rate, line) for line in lines)
    assert any(line.startswith("bench: total: ") for line in lines)
    result = json.loads(json_path.read_text())
    assert result["world_size"] == ranks and len(result["per_rank"]) == ranks
    assert result["warmup_steps"] == 1 and result["steps"] == 2 and len(result["repeats_images_per_sec"]) == 2
    # Every timed repeat ran all of its steps (a benchmark that times nothing must not pass).
    assert result["steps_run"] == [2, 2], result
    assert result["samples_run"] == [2 * ranks * 4 * passes] * 2, result
    total = float([line for line in lines if line.startswith("images_per_sec=")][-1].split("=")[1])
    assert total == pytest.approx(result["images_per_sec"], abs=0.01) and total > 0
    for row in result["per_rank"]:  # a rank's rate is its own samples over its own time
        assert row["images_per_sec"] == pytest.approx(total / ranks, rel=0.5), result
    return result


def test_bench_single_process_with_accumulation_and_compression(tmp_path):
    out = tmp_path / "bench.json"
    run = launch("single", 1, ["-m", "hvdtrain", "bench", *TINY, "--json", str(out),
                               "train.backward_passes_per_step=2", "dist.compression=fp16"], tmp_path)
    result = check(run.stdout, 1, out, passes=2)
    assert result["compression"] == "fp16" and result["backward_passes_per_step"] == 2
    assert "bench: fp32 " not in run.stdout  # no forecast unless a link is given


def test_bench_forecasts_scaling_from_its_own_step_and_gradients(tmp_path):
    out = tmp_path / "bench.json"
    run = launch("single", 1, ["-m", "hvdtrain", "bench", *TINY, "--json", str(out), "--link-gbit", "0.25"], tmp_path)
    result = check(run.stdout, 1, out)
    assert result["gradient_bytes"] == 11_689_512 * 4  # resnet18's parameters (1000 classes), float32
    # the step it timed: 4 images a step at the rate it measured (a mean of rates; a mean of times)
    assert result["step_seconds"] == pytest.approx(4 / result["images_per_sec"], rel=0.3)
    lines = result_lines(run.stdout)
    assert lines[-1].startswith("images_per_sec=")
    step, grads, link = result["step_seconds"], result["gradient_bytes"], 0.25e9 / 8
    expected = format_forecast(step, grads, link, prefix="bench: ")
    assert lines[-1 - len(expected):-1] == expected
    assert result["forecast_table"]["fp32"][0]["factor"] == pytest.approx(step / max(step, grads / link))


@pytest.mark.parametrize("launcher, controller", [("horovodrun-gloo", "gloo"), ("mpirun", "mpi")])
def test_bench_two_ranks(launcher, controller, tmp_path):
    out = tmp_path / "bench.json"
    run = launch(launcher, 2, ["-m", "hvdtrain", "bench", *TINY, "--json", str(out)], tmp_path)
    result = check(run.stdout, 2, out)
    assert result["controller"] == controller and result["compression"] == "none"
    assert result["threads_per_rank"] == 1
    # The cross-rank audit's cost: timed for real (a positive duration, every value of the state).
    assert result["audit_seconds"] > 0 and result["audit_values"] > 20 and 0 < result["audit_step_fraction"]
    assert "bench: cross-rank audit: " in run.stdout


def test_bench_rejects_bad_flags(tmp_path):
    run = launch("single", 1, ["-m", "hvdtrain", "bench", "--steps", "0"], tmp_path, check=False)
    assert run.returncode == 2
    assert run.stderr.strip() == "hvdtrain: error: --steps must be >= 1, got 0"
