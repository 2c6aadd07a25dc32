"""``dist.op=adasum``: Horovod's Adasum under the MPI controller, as Horovod's ImageNet example runs
it. The engine's step combines two ranks' updates as Adasum's formula says (and with two backward
passes a step as well); a run trains at one rank's learning rate, not scaled by the number of
ranks; under Gloo, where Horovod 0.28 has no Adasum, it is refused in one line, by the launcher
before any rank starts, and by the ranks under a plain horovodrun. And the example's other
DistributedOptimizer argument, dist.gradient_predivide_factor, reaches Horovod."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from tests.helpers import BIN, REPO, job_env, launch, read_metrics, tiny


def adasum(a: list[float], b: list[float]) -> list[float]:
    """Adasum of two updates (Maleki et al. 2020; Horovod's pairwise step)."""
    dot = sum(x * y for x, y in zip(a, b))
    norm_a, norm_b = sum(x * x for x in a), sum(y * y for y in b)
    return [(1 - dot / (2 * norm_a)) * x + (1 - dot / (2 * norm_b)) * y for x, y in zip(a, b)]


def test_adasum_combines_the_ranks_updates_as_its_formula_says(tmp_path):
    result = launch("mpirun", 2, [str(REPO / "tests" / "parallel" / "adasum_probe.py")], tmp_path, timeout=180)
    lines = [json.loads(line[line.index("{"):]) for line in result.stdout.splitlines() if '"rank"' in line]
    assert sorted(entry["rank"] for entry in lines) == [0, 1], result.stdout
    # Each rank's SGD update is -0.1 x its own gradient: (-0.1, 0) on rank 0, (-0.1, -0.1) on rank 1.
    combined = adasum([-0.1, 0.0], [-0.1, -0.1])
    expected = [1.0 + combined[0], 2.0 + combined[1]]
    assert expected == pytest.approx([0.875, 1.925])  # an average would give (0.9, 1.95), a sum (0.8, 1.9)
    for entry in lines:
        assert entry["one_pass"] == pytest.approx(expected, abs=1e-6), lines
        assert entry["two_passes"] == pytest.approx(expected, abs=1e-6), lines


def test_a_run_with_adasum_trains_under_mpirun_at_one_ranks_rate(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    """The run's end-of-epoch audit (runtime.audit=stop) finds the ranks' weights equal; their
    momentum buffers are each rank's own under Adasum, and are left out of it."""
    result = launch("mpirun", 2, ["-m", "hvdtrain", *tiny(tiny_data, run_dir, "dist.op=adasum",
                                                          "optim.schedule=constant")], tmp_path)
    # debug: optim.base_lr 0.4 per 256 images, 8 images per rank: 0.0125, where averaging 2 ranks takes 0.025.
    assert ("lr 0.0125 (optim.base_lr 0.4 per 256 images = 0.0125 for one rank's 8; Adasum: for 8 images, "
            "not scaled by the 2 ranks), no warm-up"
            in result.stdout), result.stdout[-3000:]
    train = [record for record in read_metrics(run_dir) if record["split"] == "train"]
    assert len(train) == 2 and train[1]["loss"] < train[0]["loss"] and math.isfinite(train[1]["loss"]), train
    assert all(record["lr"] == pytest.approx(0.0125) for record in train), train


def test_adasum_under_gloo_is_refused_in_one_line(tiny_data, tmp_path):
    program = ["-m", "hvdtrain", *tiny(tiny_data, tmp_path / "run", "dist.op=adasum")]
    line = ("dist.op=adasum needs Horovod's MPI controller (Horovod's Adasum runs on MPI alone), and this job runs "
            "on gloo: launch with horovodrun --mpi (hvdtrain launch --mpi) or mpirun, or set dist.op=average")
    launched = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2",
                               "--gloo", str(BIN / "python"), *program], cwd=tmp_path, env=job_env(tmp_path),
                              capture_output=True, text=True, timeout=300)
    assert launched.returncode == 2, launched.stdout + launched.stderr
    assert launched.stderr.strip().splitlines()[-1] == (
        f"hvdtrain launch: exit 2 (bad configuration or data), before any rank started: error: {line}")
    assert not (tmp_path / "run").exists()
    ranks = launch("horovodrun-gloo", 2, program, tmp_path, check=False)
    assert ranks.returncode != 0 and line in ranks.stdout + ranks.stderr, ranks.stdout[-3000:] + ranks.stderr[-3000:]
    assert "Traceback" not in ranks.stdout + ranks.stderr


def test_gradient_predivide_factor_keeps_an_fp16_sum_in_range(tmp_path):
    """dist.gradient_predivide_factor reaches Horovod's DistributedOptimizer: gradients of 60000 on two
    ranks, sent as float16, overflow the plain sum (inf) and average to 60000 when halved first."""
    result = launch("mpirun", 2, [str(REPO / "tests" / "parallel" / "predivide_probe.py")], tmp_path, timeout=180)
    lines = [json.loads(line[line.index("{"):]) for line in result.stdout.splitlines() if '"rank"' in line]
    assert sorted(entry["rank"] for entry in lines) == [0, 1], result.stdout
    for entry in lines:
        assert math.isinf(entry["factor_1"][0]) and entry["factor_1"][1] == 2.0, lines
        assert entry["factor_2"] == [60000.0, 2.0], lines
