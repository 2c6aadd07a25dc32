"""Targets and best.pt follow the direction each task declares for its metrics, in real runs: the
recommender's RMSE and MAE (lower is better) and a user task's error rate. Before, a target on RMSE
stopped at the first epoch above it, and best.pt with checkpoint.best_metric=mae kept the worst epoch.

One process each (no launcher): the direction logic runs the same on every rank, on global sums."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import BIN, REPO, example_task_variant, job_env, read_metrics

COMMON = ["output.tensorboard=false", "output.progress=false", "runtime.stats_interval=0", "runtime.threads=1",
          "checkpoint.resume=never"]


@pytest.fixture(scope="module")
def ratings_dir(tmp_path_factory) -> Path:
    from hvdtrain.data.ratings.movielens import generate_ratings, write_ratings_csv

    folder = tmp_path_factory.mktemp("ratings")
    write_ratings_csv(folder / "ratings.csv", *generate_ratings(num_users=40, num_items=200, num_ratings=2000))
    return folder


def train(tmp: Path, *args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([str(BIN / "python"), "-m", "hvdtrain", *args, *COMMON], cwd=tmp, env=job_env(tmp),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def recommender(ratings_dir: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--config", "movielens", f"data.dir={ratings_dir}", f"output.dir={run_dir}", "train.epochs=3",
            "train.batch_size=64", "recommendation.split=random", *extra]


def val_records(run_dir: Path) -> list[dict]:
    return [r for r in read_metrics(run_dir) if r["split"] == "val"]


def test_an_unreachable_rmse_target_trains_every_epoch(ratings_dir, tmp_path):
    result = train(tmp_path, *recommender(ratings_dir, tmp_path / "run", "train.target=0.05"))
    val = val_records(tmp_path / "run")
    assert len(val) == 3 and not any(r.get("target_reached") for r in val), [r["rmse"] for r in val]
    assert "target: stop at val rmse <= 0.05" in result.stdout


def test_a_reachable_rmse_target_stops_at_the_first_epoch_at_or_below_it(ratings_dir, tmp_path):
    # Find where the run goes, then aim between its first and its last epoch.
    train(tmp_path, *recommender(ratings_dir, tmp_path / "probe"))
    rmse = [r["rmse"] for r in val_records(tmp_path / "probe")]
    assert rmse[-1] < rmse[0], rmse
    target = (rmse[0] + min(rmse)) / 2
    expected = next(epoch for epoch, value in enumerate(rmse) if value <= target)
    result = train(tmp_path, *recommender(ratings_dir, tmp_path / "run", f"train.target={target}"))
    val = val_records(tmp_path / "run")
    assert len(val) == expected + 1 and val[-1]["target_reached"] and val[-1]["target_metric"] == "rmse"
    assert val[-1]["rmse"] <= target < val[-2]["rmse"] if expected else True
    assert f"target reached: val rmse {val[-1]['rmse']:.4g} <= {target:g}" in result.stdout


def test_best_pt_keeps_the_lowest_mae(ratings_dir, tmp_path):
    run_dir = tmp_path / "run"
    train(tmp_path, *recommender(ratings_dir, run_dir, "checkpoint.best_metric=mae", "train.epochs=4"))
    mae = [r["mae"] for r in val_records(run_dir)]
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["best_metric"] == min(mae) and best["epoch"] == mae.index(min(mae)) + 1, mae
    assert max(mae) != min(mae)


USER_TASK = '''

class ErrorTask(TabularTask):
    """The example task reporting an error rate (lower is better) besides its accuracy."""

    metric_directions = {"loss": "min", "accuracy": "max", "error": "min"}

    def summarize(self, sums):
        metrics = super().summarize(sums)
        metrics["error"] = 100.0 - metrics["accuracy"]
        return metrics
'''


@pytest.fixture(scope="module")
def user_task(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user_task")
    example_task_variant(folder, "error_task", USER_TASK)
    return folder


def user_args(folder: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--config", str(REPO / "examples" / "custom_task" / "config.yaml"),
            f"task={folder / 'error_task.py'}:ErrorTask", f"output.dir={run_dir}", "train.epochs=3", *extra]


def test_a_user_tasks_lower_is_better_metric_picks_best_pt_and_its_target(user_task, tmp_path):
    run_dir = tmp_path / "run"
    train(tmp_path, *user_args(user_task, run_dir, "checkpoint.best_metric=error", "train.target=0.001"))
    val = val_records(run_dir)
    error = [r["error"] for r in val]
    assert len(val) == 3 and not any(r.get("target_reached") for r in val), error  # 0.001% is out of reach
    best = torch.load(run_dir / "checkpoints" / "best.pt", weights_only=True)
    assert best["best_metric"] == min(error)
    # And a target above the first epoch's error stops there.
    train(tmp_path, *user_args(user_task, tmp_path / "stop", "train.target_metric=error", f"train.target={error[0]}"))
    assert len(val_records(tmp_path / "stop")) == 1 and val_records(tmp_path / "stop")[0]["target_reached"]


def test_a_metric_without_a_direction_stops_before_training(user_task, tmp_path):
    result = subprocess.run([str(BIN / "python"), "-m", "hvdtrain",
                             *user_args(user_task, tmp_path / "run", "checkpoint.best_metric=samples"), *COMMON],
                            cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "does not say whether a higher or a lower 'samples' is better" in errors[0], errors
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
