"""Today's ImageNet recipes, one process: the update rules of LARS and LAMB against their formulas on
hand-computed tensors, the poly schedule, FFCV's resolution schedule against a table, the EMA and
its warm-up, mixup/cutmix against torchvision's transforms and label smoothing, per-sample seeded
policies, the presets, and one-line errors for bad settings."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from hvdtrain.config import PACKAGED_CONFIGS, AugmentConfig, ConfigError, EmaConfig, OptimConfig
from hvdtrain.data.image.mixing import BatchMix, MixDraw, cutmix_draw
from hvdtrain.data.image.policies import Augmented, policy_ops
from hvdtrain.data.image.resolution import resolution_at
from hvdtrain.data.sampler import SeededSamples
from hvdtrain.job_config import load_config
from hvdtrain.optim.build import LRSchedule, build_optimizer, lr_at
from hvdtrain.optim.ema import ModelEma, ema_decay
from hvdtrain.optim.lars_lamb import LAMB, LARS

RECIPES = ["ffcv_rn50_16_epochs", "ffcv_rn50_32_epochs", "ffcv_rn50_88_epochs", "mlperf_lars_rn50",
           "nvidia_rn50_v15", "timm_rsb_a3"]


def one_param(values, grad) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))
    param.grad = torch.tensor(grad, dtype=torch.float64)
    return param


# --- LARS and LAMB ------------------------------------------------------------------------------

def test_lars_matches_the_mlperf_formula_by_hand():
    # w = (3, 4): ||w|| = 5; g = (0.6, 0.8): ||g|| = 1; wd 0.1, eta 0.001, lr 2, momentum 0.9.
    # trust = 0.001 * 5 / (1 + 0.1 * 5) = 1/300; v = 2/300 * (g + 0.1 w) = 2/300 * (0.9, 1.2) = (0.006, 0.008)
    w = one_param([3.0, 4.0], [0.6, 0.8])
    excluded = one_param([1.0], [0.5])  # a bias: no trust ratio, no weight decay
    opt = LARS([{"params": [w], "weight_decay": 0.1, "adapt": True},
                {"params": [excluded], "weight_decay": 0.0, "adapt": False}], lr=2.0, momentum=0.9, eta=0.001)
    opt.step()
    assert torch.allclose(w.detach(), torch.tensor([2.994, 3.992], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(excluded.detach(), torch.tensor([0.0], dtype=torch.float64))  # 1 - 2 * 0.5
    # Second step, same gradient: ||w1|| = 4.99 (w1 = 0.998 w); trust = 0.00499 / (1 + 0.499).
    w.grad = torch.tensor([0.6, 0.8], dtype=torch.float64)
    excluded.grad = torch.tensor([0.5], dtype=torch.float64)
    opt.step()
    trust = 0.001 * 4.99 / (1 + 0.1 * 4.99)
    v2 = [0.9 * 0.006 + 2 * trust * (0.6 + 0.1 * 2.994), 0.9 * 0.008 + 2 * trust * (0.8 + 0.1 * 3.992)]
    expected = torch.tensor([2.994 - v2[0], 3.992 - v2[1]], dtype=torch.float64)
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-12)
    assert torch.allclose(excluded.detach(), torch.tensor([0.0 - (0.9 * 1.0 + 2 * 0.5)], dtype=torch.float64))


def test_lars_nesterov_and_zero_weights():
    w = one_param([3.0, 4.0], [0.6, 0.8])
    zero = one_param([0.0, 0.0], [1.0, 1.0])  # ||w|| = 0: trust 1, the plain rate
    opt = LARS([{"params": [w, zero], "weight_decay": 0.0, "adapt": True}], lr=2.0, momentum=0.9, eta=0.001,
               nesterov=True)
    opt.step()
    update = 2 * 0.005 * torch.tensor([0.6, 0.8], dtype=torch.float64)  # trust = 0.001 * 5 / 1
    assert torch.allclose(w.detach(), torch.tensor([3.0, 4.0], dtype=torch.float64) - (0.9 * update + update))
    assert torch.allclose(zero.detach(), torch.tensor([-2 * 1.9, -2 * 1.9], dtype=torch.float64))


def test_lamb_matches_the_paper_formula_by_hand():
    w = one_param([3.0, 4.0], [0.6, 0.8])
    opt = LAMB([{"params": [w], "weight_decay": 0.1, "adapt": True}], lr=0.01, betas=(0.9, 0.999), eps=1e-6)
    opt.step()
    # t = 1: m_hat = g, v_hat = g^2, so r = g / (|g| + eps); u = r + 0.1 w; trust = ||w|| / ||u||.
    u = [0.6 / (0.6 + 1e-6) + 0.3, 0.8 / (0.8 + 1e-6) + 0.4]
    trust = 5.0 / math.hypot(*u)
    expected = torch.tensor([3 - 0.01 * trust * u[0], 4 - 0.01 * trust * u[1]], dtype=torch.float64)
    assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-12)
    # t = 2 with gradient (0.3, -0.4), written out from the paper's bias-corrected moments.
    w1 = expected.clone()
    w.grad = torch.tensor([0.3, -0.4], dtype=torch.float64)
    opt.step()
    g1, g2 = np.array([0.6, 0.8]), np.array([0.3, -0.4])
    m = 0.9 * (0.1 * g1) + 0.1 * g2
    v = 0.999 * (0.001 * g1 ** 2) + 0.001 * g2 ** 2
    r = (m / (1 - 0.9 ** 2)) / (np.sqrt(v / (1 - 0.999 ** 2)) + 1e-6)
    u2 = r + 0.1 * w1.numpy()
    expected2 = w1.numpy() - 0.01 * (np.linalg.norm(w1.numpy()) / np.linalg.norm(u2)) * u2
    assert np.allclose(w.detach().numpy(), expected2, rtol=0, atol=1e-12)


def test_lamb_excluded_group_is_plain_adam():
    b = one_param([1.0], [0.5])
    LAMB([{"params": [b], "weight_decay": 0.0, "adapt": False}], lr=0.01).step()
    assert torch.allclose(b.detach(), torch.tensor([1 - 0.01 * 0.5 / (0.5 + 1e-6)], dtype=torch.float64))


@pytest.mark.parametrize("name, cls", [("lars", LARS), ("lamb", LAMB), ("adamw", torch.optim.AdamW),
                                       ("sgd", torch.optim.SGD)])
def test_build_optimizer_excludes_biases_and_norms(name, cls):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    opt = build_optimizer(model, OptimConfig(name=name, weight_decay=1e-4), lr=0.1)
    assert type(opt) is cls
    if name in ("lars", "lamb"):
        adapted = [g["adapt"] for g in opt.param_groups]
        decays = [g["weight_decay"] for g in opt.param_groups]
        assert (adapted, decays) == ([True, False], [1e-4, 0.0])
        # Horovod's DistributedOptimizer re-creates the class from the groups alone.
        again = cls(opt.param_groups)
        assert [g["adapt"] for g in again.param_groups] == [True, False]


# --- schedules ----------------------------------------------------------------------------------

def test_poly_schedule_after_warmup():
    sched = LRSchedule(peak_lr=3.2, start_lr=0.1, warmup_epochs=2, epochs=10, steps_per_epoch=10,
                       schedule="poly", end_lr=1e-4, poly_power=2.0)
    assert lr_at(0, sched) == pytest.approx(0.1)
    assert lr_at(20, sched) == pytest.approx(3.2)
    # Half-way through the decay: end + (peak - end) * 0.5^2.
    assert lr_at(60, sched) == pytest.approx(1e-4 + (3.2 - 1e-4) * 0.25)
    assert lr_at(100, sched) == pytest.approx(1e-4)
    linear = LRSchedule(peak_lr=1.0, start_lr=1.0, warmup_epochs=0, epochs=4, steps_per_epoch=1,
                        schedule="poly", poly_power=1.0)
    assert [lr_at(s, linear) for s in range(5)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    cosine = LRSchedule(peak_lr=1.0, start_lr=1.0, warmup_epochs=0, epochs=4, steps_per_epoch=1,
                        schedule="cosine", end_lr=0.2)
    assert [lr_at(s, cosine) for s in (0, 2, 4)] == pytest.approx([1.0, 0.6, 0.2])


def test_resolution_schedule_table():
    # FFCV's rn50_88_epochs (160 -> 192 between epochs 65 and 76): 160 + 32 * (e - 65) / 11 rounds
    # to 160 (5 x 32) up to 177.45 / 32 = 5.55 at epoch 71.
    table_88 = {0: 160, 65: 160, 66: 160, 70: 160, 71: 192, 75: 192, 76: 192, 87: 192}
    assert {e: resolution_at(e, 160, 192, 65, 76) for e in table_88} == table_88
    # 128 -> 256 over epochs 0..4: 160, 192, 224 in between (exact multiples of 32).
    assert [resolution_at(e, 128, 256, 0, 4) for e in range(6)] == [128, 160, 192, 224, 256, 256]
    # 32 -> 64 over 0..3 (the exact-resume test): 42.7 -> 32, 53.3 -> 64. Ties go to even (48 -> 64).
    assert [resolution_at(e, 32, 64, 0, 3) for e in range(4)] == [32, 32, 64, 64]
    assert resolution_at(1, 32, 64, 0, 2) == 64
    # The same as FFCV's numpy expression, everywhere on a grid.
    for e in range(90):
        interp = np.interp([e], [65, 76], [160, 192])[0]
        ffcv = 160 if e <= 65 else 192 if e >= 76 else int(np.round(interp / 32)) * 32
        assert resolution_at(e, 160, 192, 65, 76) == ffcv


# --- EMA ----------------------------------------------------------------------------------------

def test_ema_decay_warmup_as_timm_v3():
    cfg = EmaConfig(decay=0.9998, warmup=True, warmup_gamma=1.0, warmup_power=0.75)
    # timm ModelEmaV3.get_decay(step): t = step - 1; 0 at t = 0; 1 - (1 + t)^-power, capped at decay.
    assert ema_decay(1, cfg) == 0.0
    assert ema_decay(2, cfg) == pytest.approx(1 - 2 ** -0.75)
    assert ema_decay(11, cfg) == pytest.approx(1 - 11 ** -0.75)
    assert ema_decay(10 ** 9, cfg) == 0.9998
    assert ema_decay(5, EmaConfig(decay=0.99, warmup=False)) == 0.99


def test_ema_update_and_state_round_trip():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    ema = ModelEma(model, EmaConfig(decay=0.5, warmup=False))
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)  # 0.5 * old + 0.5 * (old + 1)
    assert all(torch.allclose(e, b + 0.5) for e, b in zip(ema.module.parameters(), before))
    model[1].running_mean.fill_(3.0)
    ema.copy_buffers(model)
    assert torch.equal(ema.module[1].running_mean, torch.full((2,), 3.0))
    other = ModelEma(model, EmaConfig(decay=0.5))
    other.load_state_dict(ema.state_dict())
    assert other.updates == 1 and all(torch.equal(a, b) for a, b in
                                      zip(other.module.state_dict().values(), ema.module.state_dict().values()))


# --- mixup / cutmix -----------------------------------------------------------------------------

class FixedBeta:
    def __init__(self, lam: float):
        self.lam = lam

    def sample(self, shape):
        return torch.tensor(self.lam)


def test_mixup_and_cutmix_equal_torchvision_for_the_same_draws():
    from torchvision.transforms import v2

    images, labels = torch.randn(4, 3, 10, 12), torch.tensor([0, 2, 1, 2])
    mixer = BatchMix(0.2, 1.0, 1.0, 0.5, num_classes=3)
    mixup = v2.MixUp(alpha=0.2, num_classes=3)
    mixup._dist = FixedBeta(0.3)
    expected = mixup(images, labels)
    actual = mixer.apply(images, labels, MixDraw("mixup", 0.3))
    assert torch.allclose(actual[0], expected[0]) and torch.allclose(actual[1], expected[1])

    cutmix = v2.CutMix(alpha=1.0, num_classes=3)
    cutmix._dist = FixedBeta(0.6)
    torch.manual_seed(5)
    expected = cutmix(images, labels)
    torch.manual_seed(5)
    center_x, center_y = int(torch.randint(12, size=(1,))), int(torch.randint(10, size=(1,)))
    actual = mixer.apply(images, labels, cutmix_draw(0.6, center_x, center_y, 10, 12))
    assert torch.equal(actual[0], expected[0]) and torch.allclose(actual[1], expected[1])


def test_mix_draws_depend_only_on_the_seed_and_obey_the_probabilities():
    mixer = BatchMix(0.2, 1.0, mix_prob=0.5, switch_prob=0.25, num_classes=5)
    assert mixer.draw(123, 8, 8) == mixer.draw(123, 8, 8)
    kinds = [mixer.draw(seed, 32, 32).kind for seed in range(4000)]
    assert kinds.count("none") / 4000 == pytest.approx(0.5, abs=0.03)
    assert kinds.count("cutmix") / 4000 == pytest.approx(0.5 * 0.25, abs=0.03)
    mixup_only = BatchMix(0.4, 0.0, 1.0, 0.5, num_classes=5)
    lams = [mixup_only.draw(seed, 8, 8).lam for seed in range(4000)]
    assert np.mean(lams) == pytest.approx(0.5, abs=0.02)  # Beta(a, a) has mean 1/2
    assert np.var(lams) == pytest.approx(1 / (4 * (2 * 0.4 + 1)), abs=0.01)  # and variance 1/(4(2a+1))


def test_label_smoothing_on_mixed_targets_equals_timm_mixup_target():
    torch.manual_seed(0)
    logits, labels, eps, lam, classes = torch.randn(4, 5), torch.tensor([0, 3, 3, 1]), 0.1, 0.7, 5
    _, soft = BatchMix(0.2, 0.0, 1.0, 0.5, classes).apply(torch.zeros(4, 3, 2, 2), labels, MixDraw("mixup", lam))
    # timm's mixup_target: smooth each one-hot (off = eps / C, on = 1 - eps + off), then mix.
    off, on = eps / classes, 1 - eps + eps / classes
    smooth = torch.full((4, classes), off).scatter_(1, labels.view(-1, 1), on)
    target = lam * smooth + (1 - lam) * smooth.roll(1, 0)
    expected = -(target * F.log_softmax(logits, dim=1)).sum(1).mean()
    assert F.cross_entropy(logits, soft, label_smoothing=eps) == pytest.approx(float(expected), rel=1e-6)


def test_soft_targets_score_the_dominant_label(tmp_path):
    from hvdtrain.tasks.image_classification import hit_counts

    logits = torch.tensor([[5.0, 0, 0], [0, 5.0, 0]])
    soft = torch.tensor([[0.7, 0.3, 0.0], [0.6, 0.4, 0.0]])  # dominant labels 0 and 0
    assert [int(v) for v in hit_counts(logits, soft)] == [1, 2]


# --- per-sample policies ------------------------------------------------------------------------

class Crops(torch.utils.data.Dataset):
    """Random uint8 'decoded crops' (HWC memory, like crops.TrainCrop's) through a policy op."""

    def __init__(self, op):
        self.images = torch.randint(0, 256, (4, 24, 24, 3), dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(0)).permute(0, 3, 1, 2)
        self.transform = Augmented(lambda index: self.images[index], op)

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.transform(index)


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment", "autoaugment"])
def test_policies_are_seeded_per_sample(policy):
    samples = SeededSamples(Crops(policy_ops(AugmentConfig(policy=policy, random_erase=0.5))))
    first = [samples[(i, 1000 + i)] for i in range(4)]
    again = [samples[(i, 1000 + i)] for i in range(4)]
    other = [samples[(i, 2000 + i)] for i in range(4)]
    assert all(t.dtype == torch.uint8 and t.shape == (3, 24, 24) for t in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not all(torch.equal(a, b) for a, b in zip(first, other))
    torch.manual_seed(7)
    state = torch.get_rng_state()
    samples[(0, 5)]
    assert torch.equal(torch.get_rng_state(), state)  # the caller's generator is untouched


def test_no_policy_is_no_op():
    assert policy_ops(AugmentConfig()) is None


# --- presets and bad settings ------------------------------------------------------------------

def test_every_preset_resolves_and_names_its_source():
    shipped = {p.stem for p in PACKAGED_CONFIGS.glob("*.yaml")}
    assert set(RECIPES) <= shipped
    for name in RECIPES:
        cfg = load_config(name)
        text = (PACKAGED_CONFIGS / f"{name}.yaml").read_text()
        assert "Source:" in text and "Published:" in text and "not reproduced" in text
        assert cfg.model.arch == "resnet50"


@pytest.mark.parametrize("override, words", [
    ("augment.mixup_alpha=-1", "augment.mixup_alpha' must be >= 0"),
    ("optim.momentum=1.0", "optim.momentum' must be in [0, 1) for optim.name=lars"),
    ("optim.momentum=-0.1", "optim.momentum' must be in [0, 1) for optim.name=lars"),
    ("data.min_res=192", "data.min_res' (192) must not exceed data.max_res (160)"),
    ("augment.random_erase=1.5", "augment.random_erase' is a probability"),
    ("ema.decay=1", "ema.decay' must be in [0, 1)"),
    ("checkpoint.best_metric=ema_top1", "needs the EMA"),
])
def test_bad_recipe_settings_get_one_line(override, words):
    base = ["optim.name=lars", "data.min_res=128", "data.max_res=160", "data.end_ramp=3"]
    with pytest.raises(ConfigError) as error:
        load_config(None, base + [override])
    assert words in str(error.value) and "\n" not in str(error.value)


def test_readme_table_lists_every_preset():
    readme = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    assert all(f"`{name}`" in readme for name in RECIPES)


def test_bench_data_measures_every_policy(tmp_path, capsys):
    from hvdtrain.data.demo import generate
    from hvdtrain.tools.bench_data import main

    generate(tmp_path / "data", train_per_class=4, val_per_class=1, size=40, num_classes=2)
    with pytest.raises(ConfigError, match="use data.workers=0, not 2"):
        main([f"data.dir={tmp_path / 'data'}", "data.workers=2"])
    # data.workers is 0 without being asked (the default config has 4).
    assert main([f"data.dir={tmp_path / 'data'}", "runtime.threads=1", "data.image_size=32",
                 "train.batch_size=4", "--rounds", "2", "--batches", "1", "--policies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "workers 0," in lines[0]
    timed = [line for line in lines if line.startswith("images_timed[")]
    assert len(timed) == 5 and all(line.endswith("]=8") for line in timed)  # 2 rounds x 1 batch x 4 images
    measured = [line for line in lines if line.startswith("policy ")]
    assert [line.split(":")[0] for line in measured] == ["policy trivialaugment", "policy randaugment",
                                                         "policy autoaugment", "policy random_erase=0.25"]
    assert all(float(line.split(": ")[1].split()[0]) > 0 for line in measured)
    # Each pipeline ran its warm-up round and one measured round of one batch of 4 images.
    assert sum(line.startswith("round 1:") for line in lines) == 1 and lines[-1].startswith("images_per_sec=")


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_bench_data_cold_rounds_drop_the_page_cache_and_still_time_every_image(tmp_path, capsys):
    from hvdtrain.data.demo import generate
    from hvdtrain.tools.bench_data import main

    generate(tmp_path / "data", train_per_class=4, val_per_class=1, size=40, num_classes=2)
    assert main([f"data.dir={tmp_path / 'data'}", "runtime.threads=1", "data.image_size=32", "train.batch_size=4",
                 "--rounds", "2", "--batches", "1", "--compare", "--cold"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line for line in lines if line.startswith("images_timed[")] == [
        "images_timed[hvdtrain]=8", "images_timed[reference]=8"]
    assert "files_opened_per_image[hvdtrain]=1.0000" in lines
