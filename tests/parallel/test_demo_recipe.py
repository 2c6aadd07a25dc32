"""``make demo``'s recipe, through benchmarks/seed_spread.py (the benchmark that measures its spread
over seeds, threads per rank and CPU kernels): one full run, seed 0, 2 ranks under horovodrun.

The old recipe (0.1 from the first step) blew the network up in epoch 1 on every machine (val loss
800-2000) and ended at 54.0% on AVX-512, 82.5% with AVX2 kernels; this run must keep epoch 1 tame
and end above 90%. The benchmark's own counts say the work ran: 8 epochs, 120 steps, 7,680 samples."""

from __future__ import annotations

import json
import subprocess

from tests.helpers import BIN, REPO, job_env


def test_the_demo_recipe_is_stable_and_the_spread_benchmark_runs(tmp_path):
    result = subprocess.run([str(BIN / "python"), str(REPO / "benchmarks" / "seed_spread.py"), "--seeds", "0",
                             "--threads", "1", "--work", str(tmp_path / "work")],
                            cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=900)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    (run,) = report["runs"]
    assert "failed" not in run, run.get("log")
    assert (run["epochs"], run["steps"], run["samples"]) == (8, 120, 7680), run
    assert run["first_val_loss"] < 10, run  # no blow-up in epoch 1
    assert run["final"] >= 90.0, run
    assert result.returncode == 0 and "targets: every run >= 90, spread <= 5: met" in result.stdout, result.stdout
