"""Tasks own their settings: a task's dataclass becomes the config section named after it,
set from YAML and key=value, shown by --print-config, validated beside the dataclass, recorded in
config.yaml and checkpoints; the core config knows no task; old keys stop with one line."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import subprocess
import sys
import textwrap

import pytest
import yaml

from hvdtrain.config import MOVED_KEYS, Config, ConfigError, dump_yaml, from_dict, to_dict
from hvdtrain.config.root import CORE_SECTIONS
from hvdtrain.job_config import describe_keys, load_config, validate
from hvdtrain.tasks import registry
from tests.helpers import REPO

MY_TASK = textwrap.dedent('''
    from dataclasses import dataclass

    import torch

    from hvdtrain import ConfigError, Task


    @dataclass
    class MySettings:
        hidden: int = 64
        """Width of the hidden layer."""
        activation: str = "relu"
        """relu or tanh."""

        def validate(self, cfg):
            if self.hidden <= 0:
                raise ConfigError(f"config key 'my_task.hidden' must be positive, got {self.hidden}")


    class MyTask(Task):
        name = "my_task"
        settings_class = MySettings
        sum_fields = ("loss_sum", "count")

        def build_loaders(self, env): ...
        def build_model(self): return torch.nn.Linear(2, self.settings.hidden)
        def to_device(self, batch, device, dtype): ...
        def loss(self, outputs, targets, training): ...
        def metric_sums(self, loss, outputs, targets): ...
        def summarize(self, sums): ...


    class Clashing(MyTask):
        name = "model"


    class NotADataclass(MyTask):
        name = "odd"
        settings_class = dict
''')


@pytest.fixture()
def my_task(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_settings_task.py").write_text(MY_TASK)
    monkeypatch.chdir(tmp_path)
    yield "my_settings_task.py:MyTask"
    sys.modules.pop("my_settings_task", None)


def test_the_core_config_knows_no_task():
    assert "recommendation" not in CORE_SECTIONS and "embedding_dim" not in str(dataclasses.fields(Config))
    keys = [key for key, *_ in describe_keys(with_tasks=False)]
    assert not any(key.startswith("recommendation.") for key in keys)
    assert not any(old in keys for old in MOVED_KEYS)
    # docs/config.md lists the shipped tasks' sections (describe_keys with tasks).
    with_tasks = [key for key, *_ in describe_keys()]
    assert "recommendation.embedding_dim" in with_tasks and "recommendation.negatives" in with_tasks


def test_a_shipped_tasks_settings_from_yaml_and_the_command_line(tmp_path):
    cfg = load_config("movielens_ncf", ["recommendation.embedding_dim=24"])
    assert (cfg.recommendation.objective, cfg.recommendation.embedding_dim, cfg.recommendation.negatives) == \
        ("implicit", 24, 4)
    recorded = to_dict(cfg)
    assert recorded["recommendation"]["embedding_dim"] == 24 and "embedding_dim" not in recorded["model"]
    assert yaml.safe_load(dump_yaml(cfg))["recommendation"]["mlp_layers"] == "64,32,16"
    # The task may be named after its keys, on the command line.
    late = load_config(None, ["recommendation.negatives=7", "model.arch=mf", "task=recommendation"])
    assert late.recommendation.negatives == 7
    # The shipped table and the class agree.
    from hvdtrain.tasks.recommendation.task import Recommendation
    assert registry.settings_of("recommendation") == ("recommendation", Recommendation.settings_class)
    assert registry.settings_of("image_classification") == ("", None)


def test_print_config_shows_the_tasks_section():
    out = subprocess.run([sys.executable, "-m", "hvdtrain", "--config", "movielens", "--print-config",
                          "recommendation.embedding_dim=12"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["recommendation"]["embedding_dim"] == 12


@pytest.mark.parametrize("overrides, message", [
    (["model.embedding_dim=8"], "config key 'model.embedding_dim' is now 'recommendation.embedding_dim'"),
    (["data.negatives=8"], "config key 'data.negatives' is now 'recommendation.negatives'"),
    (["recommendation.embeding_dim=8", "task=recommendation", "model.arch=mf"],
     "unknown config key 'recommendation.embeding_dim'"),
    (["recommendation.embedding_dim=0", "task=recommendation", "model.arch=mf"],
     "config key 'recommendation.embedding_dim' must be positive"),
    (["recommendation.embedding_dim=8"], "config section 'recommendation' holds the keys of task=recommendation, "
                                         "but this config's task is image_classification"),
    (["recommendaton.embedding_dim=8"], "unknown config key 'recommendaton.embedding_dim'"),
])
def test_bad_task_keys_stop_with_one_line(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_old_key_in_a_yaml_file_names_the_new_one(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text("task: recommendation\nmodel:\n  arch: mf\n  embedding_dim: 16\n")
    with pytest.raises(ConfigError, match="'model.embedding_dim' is now 'recommendation.embedding_dim'"):
        load_config(str(path))


def test_a_user_tasks_settings_are_its_own_section(my_task, tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(f"task: {my_task}\nmy_task:\n  hidden: 16\n")
    cfg = load_config(str(path), ["my_task.activation=tanh"])
    assert (cfg.my_task.hidden, cfg.my_task.activation) == (16, "tanh")
    task = registry.build_task(cfg)
    assert task.settings is cfg.my_task and task.build_model().out_features == 16
    assert to_dict(cfg)["my_task"] == {"hidden": 16, "activation": "tanh"}
    with pytest.raises(ConfigError, match="'my_task.hidden' must be positive, got 0"):
        load_config(str(path), ["my_task.hidden=0"])
    with pytest.raises(ConfigError, match="unknown config key 'my_task.hiden'.*did you mean 'my_task.hidden'"):
        load_config(str(path), ["my_task.hiden=3"])
    with pytest.raises(ConfigError, match="'my_task.hidden' expects int, got 'wide'"):
        load_config(str(path), ["my_task.hidden=wide"])


@pytest.mark.parametrize("cls, message", [
    ("Clashing", "its name is the config section of its keys"),
    ("NotADataclass", "settings_class must be a dataclass"),
])
def test_a_task_whose_settings_cannot_be_a_section_stops_with_one_line(my_task, cls, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"task=my_settings_task.py:{cls}"])


def test_a_config_with_a_task_section_survives_pickling_and_copies(my_task):
    # Loader workers started by forkserver unpickle the config (inside the task and its datasets).
    cfg = load_config(None, [f"task={my_task}", "my_task.hidden=8"])
    for clone in (pickle.loads(pickle.dumps(cfg)), copy.deepcopy(cfg)):
        assert type(clone) is type(cfg) and clone == cfg and clone.my_task.hidden == 8


def test_a_checkpoint_config_from_before_the_move_still_loads():
    # What a recommendation checkpoint recorded before tasks owned their settings: the union of keys.
    old = to_dict(load_config("movielens"))
    del old["recommendation"]
    old["model"].update(objective="implicit", embedding_dim=24, mlp_layers="8,4", embedding_l2=0.0,
                        sparse_embeddings=False)
    old["data"].update(split="random", split_fraction=0.2, negatives=3, eval_negatives=50, on_bad_line="skip",
                       ratings_cache=True)
    cfg = from_dict(old, stored=True)
    validate(cfg)
    section = cfg.recommendation
    assert (section.embedding_dim, section.split, section.negatives) == (24, "random", 3)
    # An image checkpoint recorded the recommender's keys at their defaults: they are dropped.
    image = to_dict(load_config("debug"))
    image["model"]["embedding_dim"] = 32
    image["data"]["negatives"] = 4
    cfg = from_dict(image, stored=True)
    validate(cfg)
    assert type(cfg) is Config


def test_a_stored_config_imports_nothing_until_the_caller_names_the_task(tmp_path, monkeypatch):
    marker = tmp_path / "imported"
    (tmp_path / "evil_task.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.chdir(tmp_path)
    stored = to_dict(load_config("debug"))
    stored.update(task="evil_task.py:Evil", evil={"x": 1})
    cfg = from_dict(stored, stored=True)
    assert not marker.exists() and cfg.waiting == [("evil", {"x": 1}, False)]
    sys.modules.pop("evil_task", None)


def test_the_api_takes_the_task_it_is_handed_over_the_one_a_config_file_names(my_task, tmp_path):
    # examples/custom_task/train.py: config.yaml names the task by a path relative to the example's
    # folder, the script hands the class itself; the file named in the config is never looked for.
    from hvdtrain.api import build_config

    module = registry.load_file("my_settings_task.py")
    path = tmp_path / "cfg.yaml"
    path.write_text("task: elsewhere/missing.py:MyTask\nmy_task:\n  hidden: 5\n")
    cfg = build_config(path, ["my_task.activation=tanh"], task=module.MyTask)
    assert (cfg.my_task.hidden, cfg.my_task.activation) == (5, "tanh")
    again = build_config(cfg, ["my_task.hidden=6"], task=module.MyTask)
    assert again.my_task.hidden == 6 and cfg.my_task.hidden == 5
