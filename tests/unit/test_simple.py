"""The short path (hvdtrain/simple.py) and what it needs from the core: fit_model's config layering,
the optimizer's settings recorded as optim.* keys, exact metrics, one-line refusals; a constant
learning rate and an absolute one; the global batch said once; cheap per-sample seeding; the epoch
line's best metric; the metrics a finished run returns."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset, TensorDataset

from hvdtrain.config import Config, ConfigError, OptimConfig
from hvdtrain.data.sampler import IndexedSamples, SeededSamples, sample_seed
from hvdtrain.job_config import validate
from hvdtrain.observe.metrics import last_epoch_records
from hvdtrain.optim.build import LRSchedule, lr_at
from hvdtrain.simple import DEFAULTS, ModelTask, optimizer_settings, short_path_config
from hvdtrain.tasks import DataEnv, Task
from hvdtrain.train.builders import resolve_batch_size


def small_sets(train: int = 50, val: int = 11):
    generator = torch.Generator().manual_seed(0)

    def make(n: int) -> TensorDataset:
        return TensorDataset(torch.randn(n, 4, generator=generator), torch.randint(0, 3, (n,), generator=generator))

    return make(train), make(val)


def small_task(**kwargs) -> ModelTask:
    model = torch.nn.Linear(4, 3)
    train_set, val_set = small_sets()
    kwargs.setdefault("optimizer", torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return ModelTask(model, train_set, val_set, **kwargs)


def test_the_short_path_config_layers_defaults_optimizer_user_config_and_overrides():
    task = small_task()
    cfg = short_path_config(task, {"train.epochs": 10, "train.global_batch_size": 64, "output.dir": "runs/x"},
                            ["optim.schedule=cosine"])
    assert cfg.optim.schedule == "cosine"                              # the override wins
    assert cfg.optim.warmup_epochs == DEFAULTS["optim.warmup_epochs"] == 0
    assert cfg.data.workers == 0
    assert (cfg.optim.lr, cfg.optim.name, cfg.optim.momentum, cfg.optim.nesterov, cfg.optim.weight_decay) == \
        (0.05, "sgd", 0.9, False, 0.0)                                 # what the optimizer says, recorded
    assert cfg.model.arch == "Linear"                                  # another model is another run
    assert cfg.train.epochs == 10 and cfg.train.global_batch_size == 64
    assert cfg.task == "hvdtrain.simple:ModelTask"
    # Without a schedule override the rate is held constant: the DDP script's lr=.
    assert short_path_config(task, None, ()).optim.schedule == "constant"


def test_optimizer_settings_of_adamw_and_of_an_unknown_optimizer():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert optimizer_settings(torch.optim.AdamW(params, lr=3e-4, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05)) == {
        "optim.lr": 3e-4, "optim.name": "adamw", "optim.weight_decay": 0.05, "optim.beta1": 0.8, "optim.beta2": 0.95,
        "optim.eps": 1e-7}
    assert optimizer_settings(torch.optim.RMSprop(params, lr=0.01)) == {"optim.lr": 0.01}


def test_an_optimizer_factory_a_settings_dict_and_per_group_rates():
    task = small_task(optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert task.optimizer.param_groups[0]["params"][0] is next(task.model.parameters())
    settings = small_task(optimizer={"name": "adamw", "lr": 1e-3})
    assert settings.settings_given == {"optim.name": "adamw", "optim.lr": 1e-3} and settings.optimizer is None
    cfg = short_path_config(settings, None, ())
    assert (cfg.optim.name, cfg.optim.lr) == ("adamw", 1e-3)  # the engine builds it from the optim section
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))
    two = torch.optim.SGD([{"params": model[0].parameters(), "lr": 0.2}, {"params": model[1].parameters()}], lr=0.1)
    task = ModelTask(model, *small_sets(), optimizer=two)
    assert [group["lr_mult"] for group in task.build_optimizer(model).param_groups] == [1.0, 0.5]


def test_bad_inputs_stop_with_one_line():
    model = torch.nn.Linear(4, 3)

    class Stream(IterableDataset):
        def __iter__(self):
            yield torch.zeros(4), 0

    cases = [
        (lambda: ModelTask(model, Stream(), small_sets()[1]), "train_set must be a map-style dataset"),
        (lambda: ModelTask(model, *small_sets(), optimizer=torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1)),
         "the optimizer holds parameters that are not the model's"),
        (lambda: ModelTask(model, *small_sets(), optimizer=3), "optimizer must be a torch optimizer"),
        (lambda: ModelTask("resnet", *small_sets()), "model must be a torch.nn.Module"),
        (lambda: ModelTask(model, *small_sets(), metrics={"loss": F.l1_loss}), "metric 'loss' must be"),
    ]
    for build, text in cases:
        with pytest.raises(ConfigError, match=text) as caught:
            build()
        assert "\n" not in str(caught.value)


def test_metrics_are_exact_sums_over_uneven_shards():
    task = small_task()
    outputs = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 0, 2.0], [2.0, 0, 0], [0, 2.0, 0]])
    targets = torch.tensor([0, 1, 0, 0, 2])
    # Two "ranks" with 3 and 2 samples: the global accuracy is 3/5, not the mean of 2/3 and 1/2.
    sums = sum(task.metric_sums(F.cross_entropy(outputs[part], targets[part]), outputs[part], targets[part])
               for part in (slice(0, 3), slice(3, 5)))
    metrics = task.summarize(sums)
    assert metrics["accuracy"] == pytest.approx(60.0) and metrics["samples"] == 5
    assert metrics["loss"] == pytest.approx(F.cross_entropy(outputs, targets).item())
    assert task.sum_fields == ("loss_sum", "accuracy", "samples") and task.best_metric == "accuracy"
    line = task.epoch_summary({"loss": 0.5}, {"loss": 0.25, "accuracy": 98.333})
    assert line == "train loss 0.5000 | val loss 0.2500, val accuracy 98.33%"
    # A loss that is not a classifier's has no accuracy unless asked; a metric of one's own, lower better.
    regression = small_task(loss=F.mse_loss, metrics={"abs_error": (lambda out, y: (out - y).abs().mean(1), "min")})
    assert regression.sum_fields == ("loss_sum", "abs_error", "samples")
    assert regression.metric_directions["abs_error"] == "min" and not regression.higher_is_better


def test_loaders_shard_one_global_order_and_validate_every_sample_once():
    task = small_task(cfg=short_path_config(small_task(), {"train.batch_size": 4}, ()))
    seen = []
    for rank in range(2):
        loaders = task.build_loaders(DataEnv(rank=rank, world_size=2, pin_memory=False))
        assert isinstance(loaders.train.dataset, IndexedSamples)  # nothing random: no seeding cost
        seen += [float(row[0]) for inputs, _ in loaders.val for row in inputs]
        assert len(loaders.train) == 25 // 4  # 50 samples over 2 ranks, full batches
    assert sorted(seen) == sorted(float(x[0]) for x, _ in task.val_set)  # 11 samples: 6 + 5, none twice
    seeded = small_task(seed_per_sample=True)
    seeded.cfg = task.cfg
    assert isinstance(seeded.build_loaders(DataEnv(rank=0, world_size=1, pin_memory=False)).train.dataset,
                      SeededSamples)


def test_seeded_samples_draw_as_torch_manual_seed_and_restore_the_callers_streams():
    class Noisy:
        def __getitem__(self, index):
            return torch.rand(2), random.random()

    seed = sample_seed(0, 3, 17)
    torch.manual_seed(seed)
    random.seed(seed)
    expected = (torch.rand(2), random.random())
    torch.manual_seed(123)
    random.seed(123)
    before = (torch.get_rng_state(), random.getstate())
    got = SeededSamples(Noisy())[(5, seed)]
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1]
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert IndexedSamples([10, 11, 12])[(2, seed)] == 12


def test_constant_schedule_and_an_absolute_rate():
    optim = OptimConfig(schedule="constant", warmup_epochs=0, lr=0.05)
    schedule = LRSchedule.from_config(optim, global_batch=64, epochs=10, steps_per_epoch=22)
    assert {lr_at(step, schedule) for step in range(220)} == {0.05}  # not scaled by the batch, never decayed
    warm = LRSchedule.from_config(OptimConfig(schedule="constant", warmup_epochs=2, lr=0.05), 64, 10, 10)
    assert lr_at(0, warm) == 0.0 and lr_at(10, warm) == pytest.approx(0.025) and lr_at(99, warm) == 0.05
    scaled = LRSchedule.from_config(OptimConfig(schedule="constant", warmup_epochs=0, base_lr=0.2), 64, 10, 22)
    assert lr_at(100, scaled) == pytest.approx(0.05)  # optim.lr unset: base_lr per 256, scaled


def test_the_global_batch_is_said_once():
    cfg = Config()
    cfg.train.global_batch_size = 64
    resolve_batch_size(cfg, 2)
    assert cfg.train.batch_size == 32
    for world_size, batch, text in ((3, 32, "train.global_batch_size=64 does not divide into 3 ranks x 1 passes: "
                                             "use a multiple of 3 \\(e.g. 63 or 66\\)"),
                                    (2, 16, "train.batch_size=16 and train.global_batch_size=64 disagree at 2 ranks")):
        cfg = Config()
        cfg.train.global_batch_size, cfg.train.batch_size = 64, batch
        with pytest.raises(ConfigError, match=text):
            resolve_batch_size(cfg, world_size)
    cfg = Config()
    cfg.train.global_batch_size, cfg.elastic.enabled = 64, True
    with pytest.raises(ConfigError, match="cannot be used with elastic.enabled=true"):
        validate(cfg)


def test_the_default_epoch_line_shows_the_best_metric():
    class Accurate(Task):
        best_metric, higher_is_better = "accuracy", True

    task = Accurate(Config())
    assert task.epoch_summary({"loss": 1.0}, {"loss": 0.5, "accuracy": 98.3333}) == \
        "train loss 1.0000 | val loss 0.5000, val accuracy 98.33"
    assert Task(Config()).epoch_summary({"loss": 1.0}, {"loss": 0.5}) == "train loss 1.0000 | val loss 0.5000"


def test_a_finished_runs_metrics_are_read_back(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"split": "train", "epoch": 0, "step": 5, "loss": 1.0},
            {"split": "val", "epoch": 0, "step": 5, "loss": 0.9},
            {"split": "resume", "epoch": 1, "step": 5}, {"split": "train", "epoch": 1, "step": 10, "loss": 0.5},
            {"split": "val", "epoch": 1, "step": 10, "loss": 0.4, "accuracy": 97.5}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"split": "tr')  # a write cut short
    assert last_epoch_records(path, 1) == {"train": {"loss": 0.5}, "val": {"loss": 0.4, "accuracy": 97.5},
                                           "epoch": 1, "step": 10}
    assert last_epoch_records(path, 2) == {} and last_epoch_records(tmp_path / "none.jsonl", 0) == {}


def test_a_global_batch_resumes_on_another_number_of_ranks():
    from hvdtrain.checkpoint.identity import differences
    from hvdtrain.config import to_dict

    before = Config()
    before.train.global_batch_size, before.train.batch_size = 64, 32  # resolved at 2 ranks
    now = Config()
    now.train.global_batch_size, now.train.batch_size = 64, 16        # the same run at 4 ranks
    assert differences(to_dict(before), now) == ({}, {})
    now.train.global_batch_size, now.train.batch_size = 128, 32       # another global batch: another run
    assert set(differences(to_dict(before), now)[0]) == {"train.global_batch_size"}
    per_rank = Config()
    per_rank.train.batch_size = 16                                     # a per-rank batch stays compared
    assert set(differences(to_dict(Config()), per_rank)[0]) == {"train.batch_size"}


def test_the_seeding_benchmark_loads_every_sample_through_every_wrapper():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "seeding_cost.py"
    spec = importlib.util.spec_from_file_location("seeding_cost", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--samples", "40", "--repeats", "2"])
    assert set(results) == {"plain", "IndexedSamples", "SeededSamples", "before"}
    for row in results.values():
        assert row["samples"] == 80 and row["training_process_us"] > 0 and row["worker_us"] > 0
