"""Choosing a task by the config key ``task``: a shipped name, or module:Class or path.py:Class of
the user's own; the Python API's config building; hvdtrain/ never names the examples' tasks."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.config import ConfigError
from hvdtrain.data.loaders import Loaders
from hvdtrain.job_config import load_config
from hvdtrain.tasks import Task, task_class
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
    suggestion = r"unknown task 'image_clasification' \(did you mean 'image_classification'\?\)"
    with pytest.raises(ConfigError, match=suggestion):
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
                                "(the task interface: docs/tasks.md)")


def test_a_task_that_cannot_be_imported_says_why():
    with pytest.raises(ConfigError) as error:
        task_class("no_such_module:Task")
    assert str(error.value) == ("config key 'task': cannot import module 'no_such_module' "
                                "(ModuleNotFoundError: No module named 'no_such_module'; the working folder is not "
                                "on sys.path: name a file as a path, task=./file.py:Class, or add its folder to "
                                "PYTHONPATH)")


ROOT = Path(__file__).resolve().parents[2]
FILE_TASK = '''
from hvdtrain import Task
from tests.unit.test_tasks import Complete


class FromFile(Complete):
    name = "from_file"
'''


@pytest.fixture
def clean_modules():
    """Forget the modules a test loads by file path (their names are the files' names)."""
    before = set(sys.modules)
    path = list(sys.path)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]
    sys.path[:] = path


def test_a_task_from_a_file_loads_under_its_file_name(tmp_path, monkeypatch, clean_modules):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "my_file_task.py").write_text(FILE_TASK)
    monkeypatch.chdir(tmp_path)
    cls = task_class("sub/my_file_task.py:FromFile")
    # A stable name, and the folder on sys.path: a loader worker that unpickles a dataset from the
    # file imports the same module by name.
    assert cls.__module__ == "my_file_task" and sys.modules["my_file_task"].FromFile is cls
    assert str(tmp_path / "sub") in sys.path
    assert task_class(str(tmp_path / "sub" / "my_file_task.py") + ":FromFile") is cls  # loaded once


def test_file_task_errors_are_one_line(tmp_path, monkeypatch, clean_modules):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "syntax_task.py").write_text("def broken(:\n")
    (tmp_path / "json.py").write_text(FILE_TASK)
    (tmp_path / "few.py").write_text(FILE_TASK + "\nclass Other(Complete):\n    pass\n")
    (tmp_path / "plain.py").write_text("class NotATask:\n    pass\n")
    cases = {
        "missing.py:Task": f"config key 'task': no file missing.py (a path is relative to the working directory, "
                           f"{tmp_path})",
        "syntax_task.py:Task": "config key 'task': cannot import syntax_task.py (SyntaxError: invalid syntax "
                               "(syntax_task.py, line 1))",
        "json.py:FromFile": f"config key 'task': json.py would be imported as module 'json', which is already "
                            f"{sys.modules['json'].__file__} (rename the file)",
        "few.py:Nope": "config key 'task': few.py has no class 'Nope' (task classes there: Complete, FromFile, Other)",
        "plain.py:NotATask": "task 'plain.py:NotATask' is not a subclass of hvdtrain.Task (the task interface: "
                             "docs/tasks.md)",
    }
    for value, message in cases.items():
        with pytest.raises(ConfigError) as error:
            task_class(value)
        assert str(error.value) == message
    assert "syntax_task" not in sys.modules  # a failed import leaves nothing half-loaded


def test_fit_takes_a_task_class_an_instance_or_a_string():
    from hvdtrain.api import build_config
    from hvdtrain.tasks import build_task

    cfg = build_config({"train": {"epochs": 3}, "optim.base_lr": 0.2}, ["train.batch_size=4"], task=Complete)
    assert (cfg.train.epochs, cfg.optim.base_lr, cfg.train.batch_size) == (3, 0.2, 4)
    assert cfg.task == "tests.unit.test_tasks:Complete"
    assert type(build_task(cfg)) is Complete and build_task(cfg).cfg is cfg
    instance = Complete(None)
    assert build_config(["seed=5"], task=instance).task == "tests.unit.test_tasks:Complete"
    assert build_task(cfg) is instance and instance.cfg is cfg  # the instance itself, given the config
    assert build_config(ROOT / "hvdtrain" / "configs" / "debug.yaml", task="image_classification").model.arch == \
        "resnet18"
    with pytest.raises(ConfigError, match="lacks build_loaders"):
        build_config(task=Regression)
    with pytest.raises(ConfigError, match="overrides must be a list"):
        build_config(None, "train.epochs=3")


def test_importing_hvdtrain_and_its_public_names_needs_no_torch():
    check = ("import sys, hvdtrain; assert 'fit' in dir(hvdtrain); hvdtrain.fit, hvdtrain.evaluate; "
             "print(sorted({'torch', 'horovod'} & set(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert result.stdout.strip() == "[]", result.stderr


def test_hvdtrain_never_names_the_example_tasks():
    # The examples use the public interface only: nothing in the package may know them, their
    # task classes or their files.
    names, tasks = {"examples/", "custom_task", "from_ddp"}, set()
    for example in (ROOT / "examples").rglob("*.py"):
        defined = set(re.findall(r"^class (\w+)\((?:hvdtrain\.)?Task\)", example.read_text(), re.MULTILINE))
        tasks |= defined
        names |= {example.stem} if defined else set()
    found = [f"{path.relative_to(ROOT)}: {name}" for path in (ROOT / "hvdtrain").rglob("*")
             if path.is_file() and path.suffix in (".py", ".yaml", ".md")
             for name in names | tasks if re.search(rf"(?<![\w/]){re.escape(name)}(?!\w)", path.read_text())]
    assert {"TabularTask", "SpiralTask"} <= tasks and found == []
