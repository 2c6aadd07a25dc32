"""``make demo``'s recipe, through benchmarks/seed_spread.py (the benchmark that measures its spread
over seeds, threads per rank and CPU kernels): seed 0, 2 ranks under horovodrun, its first 2 epochs.

The old recipe (0.1 from the first step) blew the network up in epoch 1 on every machine (val loss
800-2000), and 0.1 after a warm-up blew up in epoch 2 once in 12 runs (val loss 960); the demo warms
up from zero over 2 epochs with the cosine after them, so a 2-epoch run trains exactly the full
run's first 2 epochs, the ones that blew up: both must stay tame. The benchmark's own counts say
the work ran: 2 epochs, 30 steps, 1,920 samples.

The figure the README quotes, every run at least 90% after the 8 epochs (100% measured, 12 runs), is
the benchmark's own target (its ``--min``), measured by the full run, not here:

    python benchmarks/seed_spread.py --seeds 0,1,2 --threads 1,2 --isa default,avx2
"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import BIN, REPO, job_env


@pytest.mark.slow
def test_the_demo_recipe_warms_up_tamely_and_the_spread_benchmark_runs(tmp_path):
    # --min 30: after 2 epochs the accuracy is not the full run's 90% target, but it is well above
    # the 10% of chance (67.5% measured for seed 0, one thread): a recipe that does not learn fails.
    result = subprocess.run([str(BIN / "python"), str(REPO / "benchmarks" / "seed_spread.py"), "--seeds", "0",
                             "--threads", "1", "--min", "30", "--work", str(tmp_path / "work"), "--",
                             "train.epochs=2"],
                            cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=900)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    (run,) = report["runs"]
    assert "failed" not in run, run.get("log")
    assert report["overrides"] == ["train.epochs=2"]
    assert (run["epochs"], run["steps"], run["samples"]) == (2, 30, 1920), run  # 15 steps of 2 x 32 per epoch
    assert len(run["val_losses"]) == 2 and max(run["val_losses"]) < 10, run  # no blow-up in the warm-up
    assert run["first_val_loss"] == run["val_losses"][0] and 30 <= run["final"] <= 100, run
    assert result.returncode == 0 and "targets: every run >= 30, spread <= 5: met" in result.stdout, result.stdout
