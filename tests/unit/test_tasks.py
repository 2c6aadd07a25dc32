"""Choosing a task by the config key ``task``: a shipped name, or module:Class of the user's own."""

from __future__ import annotations

import pytest

from hvdtrain.config import ConfigError, load_config
from hvdtrain.tasks import Task, task_class
from hvdtrain.data.loaders import Loaders
from hvdtrain.tasks.image_classification import ImageClassification
from tests.unit.test_engine import Regression


class Incomplete(Task):
    """Has sums but no loss, metric sums or summary."""

    name = "incomplete"
    sum_fields = ("count",)

    def build_loaders(self, env):
        raise NotImplementedError

    def build_model(self):
        raise NotImplementedError

    def to_device(self, batch, device, dtype):
        return batch


def test_the_default_task_is_image_classification():
    cfg = load_config("debug")
    assert cfg.task == "image_classification" and task_class(cfg.task) is ImageClassification


def test_a_mistyped_task_name_is_refused_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"unknown task 'image_clasification' \(did you mean 'image_classification'\?\)"):
        load_config("debug", ["task=image_clasification"])


class Complete(Regression):
    def build_loaders(self, env):
        return Loaders(train=[], val=[], train_sampler=None, train_size=0, val_size=0)


def test_a_task_from_the_users_own_module_loads():
    assert task_class("tests.unit.test_tasks:Complete") is Complete
    # The engine-only task of test_engine.py has no loaders: refused, naming what is missing.
    with pytest.raises(ConfigError, match="lacks build_loaders"):
        task_class("tests.unit.test_engine:Regression")


def test_a_task_that_lacks_a_method_names_it_and_the_page():
    with pytest.raises(ConfigError) as error:
        task_class("tests.unit.test_tasks:Incomplete")
    assert str(error.value) == ("task 'tests.unit.test_tasks:Incomplete' lacks loss, metric_sums, summarize "
                                "(the task interface: docs/architecture.md)")


def test_a_task_that_cannot_be_imported_says_why():
    with pytest.raises(ConfigError, match=r"cannot load 'no_such_module:Task'"):
        task_class("no_such_module:Task")
