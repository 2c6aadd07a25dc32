"""Which way a metric is better comes from the task, never from the metric's name: best.pt and
``train.target`` for a metric where lower is better (RMSE, MAE, a user's error rate), the old
``higher_is_better`` of tasks written before ``metric_directions``, and the config's one-line errors."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hvdtrain.config import ConfigError, target_value
from hvdtrain.job_config import load_config
from hvdtrain.tasks import Task, metric_direction, metric_directions
from hvdtrain.tasks.image_classification import ImageClassification
from hvdtrain.tasks.recommendation.task import Recommendation
from hvdtrain.train.run import is_better, reaches, target_metric_name


class OldStyle(Task):
    """A task written before metric_directions: best_metric and higher_is_better only."""

    name = "old"
    best_metric = "accuracy"
    higher_is_better = True


class ErrorRate(Task):
    name = "errors"
    metric_directions = {"loss": "min", "error": "min", "f1": "max"}
    best_metric = "error"


def test_the_shipped_tasks_declare_every_metric_they_report():
    image = ImageClassification(load_config("debug"))
    assert metric_directions(image) == {"loss": "min", "top1": "max", "top5": "max"}
    explicit = Recommendation(load_config("movielens"))
    assert {metric_direction(explicit, name, "k") for name in ("rmse", "mae", "baseline_rmse", "loss")} == {"min"}
    implicit = Recommendation(load_config("movielens_ncf"))
    assert implicit.best_metric == "hr10"
    assert {metric_direction(implicit, name, "k") for name in ("hr10", "ndcg10")} == {"max"}


def test_lower_is_better_where_the_task_says_so_whatever_the_name():
    task = Recommendation(load_config("movielens"))
    # MAE has no "loss" in its name: the old name-based guess took higher MAE as better.
    assert is_better(task, 0.6882, 0.7346, "mae") and not is_better(task, 0.7346, 0.6882, "mae")
    assert reaches(task, 0.80, 0.86, "rmse") and not reaches(task, 0.90, 0.86, "rmse")
    user = ErrorRate(None)
    assert is_better(user, 3.0, 5.0, "error") and is_better(user, 0.9, 0.8, "f1")
    assert reaches(user, 2.0, 2.5, "error") and not reaches(user, 0.7, 0.8, "f1")
    assert is_better(ImageClassification(load_config("debug")), 81.0, 80.0, "ema_top1")


def test_a_task_written_before_metric_directions_keeps_its_best_metric():
    task = OldStyle(None)
    assert metric_directions(task) == {"loss": "min", "accuracy": "max"}
    assert is_better(task, 0.9, 0.8, "accuracy") and is_better(task, 0.3, 0.4, "loss")


def test_an_undeclared_metric_is_refused_in_one_line():
    with pytest.raises(ConfigError) as caught:
        metric_direction(ErrorRate(None), "recall", "checkpoint.best_metric")
    message = str(caught.value)
    assert "\n" not in message and "'checkpoint.best_metric'" in message and "recall" in message
    assert "error (min)" in message and "metric_directions" in message


def test_target_and_its_old_name():
    assert target_value(load_config("debug", ["train.target=0.86"])) == 0.86
    assert target_value(load_config("debug", ["train.target_top1=75.9"])) == 75.9
    assert target_value(load_config("mlperf_lars_rn50")) == 75.9
    for overrides, words in ((["train.target=1", "train.target_top1=2"], "old name"),
                             (["train.target_metric=rmse"], "set train.target too"),
                             (["train.target=1", "train.target_metric=ema_top1"], "needs the EMA")):
        with pytest.raises(ConfigError, match=words):
            load_config("debug", overrides)


def test_the_target_applies_to_the_best_metric_unless_named():
    run = SimpleNamespace(cfg=load_config("movielens", ["train.target=0.9"]),
                          task=Recommendation(load_config("movielens")))
    assert target_metric_name(run) == ("rmse", "checkpoint.best_metric")
    run.cfg = load_config("movielens", ["train.target=0.7", "train.target_metric=mae", "checkpoint.best_metric=loss"])
    assert target_metric_name(run) == ("mae", "train.target_metric")
