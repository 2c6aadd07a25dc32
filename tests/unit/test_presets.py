"""The ImageNet presets checked line by line against their published sources, and the keys
the sources need. Every preset resolves to every row of hvdtrain/configs/published.json (the
learning-rate scaling to its global batch included); the differences it cannot express are in its
header; docs/recipes.md's tables are current. Each key is tested against its source's formula or
code, re-implemented here from the cited lines."""

from __future__ import annotations

import importlib.util
import io
import math
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image, ImageFilter
from torchvision import models, transforms

from hvdtrain.config import (
    PACKAGED_CONFIGS,
    AugmentConfig,
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    validates_after,
)
from hvdtrain.data.image.crops import CenterCrop
from hvdtrain.data.image.policies import (
    TIMM_OPS,
    TimmRandAugment,
    apply_timm_op,
    pil_affine,
    policy_ops,
    strength,
    timm_op_argument,
)
from hvdtrain.data.image.transforms import fast_eval_transform, val_resize_size
from hvdtrain.job_config import load_config
from hvdtrain.model.build import BlurPoolConv2d, build_model
from hvdtrain.optim.build import LRSchedule, build_optimizer, decay_exempt, lr_at, param_groups
from hvdtrain.optim.lars_lamb import LAMB, LARS
from hvdtrain.tasks.image_classification import bce_loss

ROOT = Path(__file__).resolve().parents[2]
IMAGENET_PRESETS = ["imagenet_resnet50", "ffcv_rn50_16_epochs", "ffcv_rn50_32_epochs", "ffcv_rn50_88_epochs",
                    "mlperf_lars_rn50", "nvidia_rn50_v15", "timm_rsb_a3", "pytorch_examples", "horovod_example"]


def recipe_tables():
    spec = importlib.util.spec_from_file_location("recipe_tables", ROOT / "scripts" / "recipe_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TABLES = recipe_tables()
PUBLISHED = TABLES.load_published()


def header(name: str) -> str:
    """The comment lines at the top of a preset file."""
    lines = (PACKAGED_CONFIGS / f"{name}.yaml").read_text().splitlines()
    return "\n".join(line for line in lines if line.startswith("#"))


# --- the presets against their sources -----------------------------------------------------------

def test_every_imagenet_preset_has_published_rows():
    assert sorted(PUBLISHED) == sorted(IMAGENET_PRESETS)
    for entry in PUBLISHED.values():
        assert entry["rows"] and entry["ranks"] >= 1 and entry["published"]["cite"]
        assert all(row["cite"] and row["published"] for row in entry["rows"])


@pytest.mark.parametrize("name", IMAGENET_PRESETS)
def test_preset_resolves_to_every_published_row(name):
    """A later edit of a preset (or of a default it relies on) that drifts from the source fails here."""
    entry, cfg = PUBLISHED[name], load_config(name)
    drifted = []
    for row in entry["rows"]:
        if row["key"] is None:
            continue
        value = TABLES.resolve(cfg, row["key"], entry["ranks"])
        if not TABLES.matches(value, row["expected"]):
            drifted.append(f"{row['name']}: {row['key']} = {value!r}, published {row['expected']!r} ({row['cite']})")
    assert not drifted, "\n".join(drifted)


@pytest.mark.parametrize("name", IMAGENET_PRESETS)
def test_header_names_the_source_the_result_and_every_difference(name):
    entry, text = PUBLISHED[name], header(name)
    assert "Source:" in text and "Published:" in text and "not reproduced here" in text
    assert "Differences that remain" in text
    assert f"{entry['published']['top1']:g}" in text
    missing = [row["name"] for row in entry["rows"] if row["key"] is None and row["name"].lower() not in text.lower()]
    assert not missing, f"{name}.yaml's header does not list {missing}"


def test_docs_tables_are_current():
    text = (ROOT / "docs" / "recipes.md").read_text()
    for name, entry in PUBLISHED.items():
        assert TABLES.current_table(text, name) == TABLES.table(name, entry), \
            f"docs/recipes.md table of {name} is stale: run python scripts/recipe_tables.py"
    assert f"hvdtrain: recipe: {startup('nvidia_rn50_v15')}\n" in text  # the start-up line shown there


# --- warm-up start and stepping --------------------------------------------------------------------

def nvidia_cosine(epoch: int, base: float = 2.048, warmup: int = 8, epochs: int = 90) -> float:
    """NVIDIA DeepLearningExamples, image_classification/optimizers.py:120-128 (lr_cosine_policy)."""
    if epoch < warmup:
        return base * (epoch + 1) / warmup
    return 0.5 * (1 + np.cos(np.pi * (epoch - warmup) / (epochs - warmup))) * base


def timm_cosine(epoch: int, peak: float = 8e-3, init: float = 1e-4, warmup: int = 5, t_initial: int = 100,
                lr_min: float = 1e-6) -> float:
    """timm's CosineLRScheduler._get_lr (cosine_lr.py:72-96 at cd638d5), warmup_prefix=False, t in epochs."""
    if epoch < warmup:
        return init + epoch * (peak - init) / warmup
    return lr_min + 0.5 * (peak - lr_min) * (1 + math.cos(math.pi * epoch / t_initial))


def test_per_epoch_warmup_at_the_epoch_end_is_nvidias_policy():
    optim = OptimConfig(base_lr=0.256, warmup_epochs=8, warmup_start=0.0, lr_step="epoch_warmup_end",
                        schedule="cosine")
    sched = LRSchedule.from_config(optim, 2048, 90, 100)
    for epoch in range(90):
        for step in (epoch * 100, epoch * 100 + 99):  # constant through the epoch
            assert lr_at(step, sched) == pytest.approx(nvidia_cosine(epoch), rel=1e-12), epoch


def test_per_epoch_timm_warmup_from_an_absolute_rate_with_the_decay_over_the_whole_run():
    optim = OptimConfig(name="lamb", base_lr=0.001, warmup_epochs=5, warmup_start_lr=1e-4, lr_step="epoch",
                        warmup_prefix=False, schedule="cosine", end_lr=1e-6)
    sched = LRSchedule.from_config(optim, 2048, 100, 50)
    for epoch in range(100):
        assert lr_at(epoch * 50 + 25, sched) == pytest.approx(timm_cosine(epoch), rel=1e-12), epoch


def test_defaults_keep_the_per_step_schedule():
    sched = LRSchedule.from_config(OptimConfig(warmup_epochs=2, schedule="cosine"), 1024, 10, 10)
    assert sched.lr_step == "step" and sched.warmup_prefix
    assert lr_at(5, sched) == pytest.approx(0.1 + (0.4 - 0.1) * 0.25)   # changes within an epoch
    assert lr_at(20, sched) == pytest.approx(0.4) and lr_at(60, sched) == pytest.approx(0.2)


def test_ffcv_cyclic_schedule_per_step():
    # libffcv/ffcv-imagenet train_imagenet.py:107-113 and 356-358: np.interp over [0, 2, E], per iteration.
    optim = OptimConfig(base_lr=0.10625, warmup_epochs=2, warmup_start=1e-4, schedule="poly", poly_power=1.0,
                        end_lr=0.0, nesterov=False)
    sched = LRSchedule.from_config(optim, 4096, 16, 312)
    for step in range(0, 16 * 312, 37):
        expected = np.interp(step / 312, [0, 2, 16], [1e-4 * 1.7, 1.7, 0])
        assert lr_at(step, sched) == pytest.approx(expected, rel=1e-9, abs=1e-12)


# --- weight-decay exemption ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def resnet50():
    return models.resnet50()


def test_exemption_rules_on_resnet50(resnet50):
    vectors = {name for name, p in resnet50.named_parameters() if p.ndim <= 1}
    assert decay_exempt(resnet50, "ndim") == vectors and len(vectors) == 107
    # Goyal et al. and NVIDIA's MLPerf LARS (fit.py:418-424): BatchNorm exempt, the fc bias decayed.
    assert vectors - decay_exempt(resnet50, "norm") == {"fc.bias"}
    # FFCV (train_imagenet.py:197) and NVIDIA DeepLearningExamples (optim/lars_lamb.py:42): 'bn' in name.
    by_name = vectors - decay_exempt(resnet50, "names", "bn")
    assert by_name == {"fc.bias"} | {f"layer{i}.0.downsample.1.{p}" for i in range(1, 5) for p in ("weight", "bias")}


def test_no_exemption_decays_every_parameter_as_sgd_over_model_parameters(resnet50):
    """pytorch/examples' imagenet/main.py: SGD(model.parameters(), weight_decay=1e-4), every tensor decayed."""
    assert decay_exempt(resnet50, "none") == set()
    groups = param_groups(resnet50, 1e-4, no_decay="none")
    decayed = [p for g in groups if g["weight_decay"] == 1e-4 for p in g["params"]]
    assert len(decayed) == len(list(resnet50.parameters())) == 161
    assert all(not g["params"] for g in groups if g["weight_decay"] == 0.0)
    # One SGD step from the same gradients equals torch's SGD over model.parameters().
    torch.manual_seed(0)
    small = models.resnet18(num_classes=10)
    reference = models.resnet18(num_classes=10)
    reference.load_state_dict(small.state_dict())
    for model in (small, reference):
        torch.manual_seed(1)
        model(torch.randn(2, 3, 32, 32)).sum().backward()
    ours = build_optimizer(small, OptimConfig(no_decay="none", nesterov=False, weight_decay=1e-4), 0.1)
    theirs = torch.optim.SGD(reference.parameters(), 0.1, momentum=0.9, weight_decay=1e-4)
    ours.step()
    theirs.step()
    assert all(torch.equal(a, b) for a, b in zip(small.parameters(), reference.parameters()))


def test_startup_line_says_every_parameter_is_decayed():
    from hvdtrain.optim.build import describe_exemption

    line = describe_exemption(models.resnet18(), OptimConfig(no_decay="none"))
    assert line == "weight decay 0.0001 on every parameter (62 tensors, 41 of them 1-d)"


def test_an_empty_name_list_points_to_no_decay_none():
    with pytest.raises(ConfigError, match=r"optim.no_decay_names'.*got ''.*optim.no_decay=none"):
        load_config(None, ["optim.no_decay=names", "optim.no_decay_names="])
    assert load_config(None, ["optim.no_decay=none", "optim.no_decay_names="]).optim.no_decay == "none"


def test_an_exempt_name_that_matches_nothing_is_refused_in_one_line(resnet50):
    with pytest.raises(ConfigError) as error:
        decay_exempt(resnet50, "names", "bn,batchnorm")
    assert "'batchnorm' is in no parameter name" in str(error.value) and "\n" not in str(error.value)


def test_groups_keep_lars_and_lamb_off_vectors_but_decay_them_where_the_rule_says(resnet50):
    optim = OptimConfig(name="lars", weight_decay=5e-5, no_decay="norm")
    optimizer = build_optimizer(resnet50, optim, 1.0)
    fc_bias = resnet50.fc.bias
    group = next(g for g in optimizer.param_groups if any(p is fc_bias for p in g["params"]))
    assert group["weight_decay"] == 5e-5 and group["adapt"] is False and len(group["params"]) == 1
    # The default rule keeps the two groups it always had.
    assert len(param_groups(resnet50, 1e-4)) == 2


# --- LARS and LAMB details ------------------------------------------------------------------------

def test_lars_decays_an_unadapted_vector_without_trust_ratio():
    param = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    param.grad = torch.tensor([0.5, 0.5], dtype=torch.float64)
    opt = LARS([{"params": [param], "weight_decay": 0.1, "adapt": False}], lr=2.0, momentum=0.9)
    opt.step()
    # v = lr * (g + wd * w) = 2 * (0.5 + 0.1 * [1, -2]) = [1.2, 0.6]; w -= v (MXNet's sgd_mom_update).
    assert torch.allclose(param.detach(), torch.tensor([-0.2, -2.6], dtype=torch.float64))


def test_lars_momentum_correction_scales_the_momentum_by_the_rate_ratio():
    param = torch.nn.Parameter(torch.tensor([3.0, 4.0], dtype=torch.float64))
    opt = LARS([{"params": [param], "weight_decay": 0.0, "adapt": False}], lr=0.0, momentum=0.9,
               momentum_correction=True)
    for lr, grad in ((0.0, 1.0), (1.0, 1.0), (2.0, 1.0)):  # a first step at lr 0 (warm-up from 0): no nan
        opt.param_groups[0]["lr"] = lr
        param.grad = torch.tensor([grad, grad], dtype=torch.float64)
        opt.step()
    # steps: v0 = 0 (lr 0); v1 = 0.9 * v0 + 1 * 1 = 1; v2 = 0.9 * (2 / 1) * v1 + 2 * 1 = 3.8 (fit.py:494-495).
    assert torch.allclose(opt.state[param]["momentum_buffer"], torch.tensor([3.8, 3.8], dtype=torch.float64))
    assert torch.allclose(param.detach(), torch.tensor([3.0 - 4.8, 4.0 - 4.8], dtype=torch.float64))
    assert opt.state_dict()["param_groups"][0]["last_lr"] == 2.0  # carried by checkpoints


def test_lamb_clips_the_global_gradient_norm_as_timms_lamb():
    torch.manual_seed(0)
    weights = [torch.randn(4, 3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    steps = [[torch.randn(4, 3, dtype=torch.float64) * 3, torch.randn(3, dtype=torch.float64) * 3],
             [torch.randn(4, 3, dtype=torch.float64) * 0.01, torch.randn(3, dtype=torch.float64) * 0.01]]
    norms = [float(torch.sqrt(sum((g ** 2).sum() for g in grads))) for grads in steps]
    assert norms[0] > 1 > norms[1]

    def run(max_norm: float, divisors: list[float]) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        opt = LAMB([{"params": params[:1], "weight_decay": 0.02, "adapt": True},
                    {"params": params[1:], "weight_decay": 0.0, "adapt": False}], lr=0.01, max_grad_norm=max_norm)
        for grads, divisor in zip(steps, divisors):
            for p, g in zip(params, grads):
                p.grad = g / divisor
            opt.step()
        return [p.detach() for p in params]

    # timm lamb.py:110-127,151: every gradient divided by ||g|| / max_grad_norm when that exceeds 1.
    clipped, by_hand = run(1.0, [1.0, 1.0]), run(0.0, [norms[0], 1.0])
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(clipped, by_hand))
    assert not torch.allclose(run(0.0, [1.0, 1.0])[0], clipped[0])


# --- binary cross-entropy ---------------------------------------------------------------------------

def timm_bce(logits, target, smoothing=0.0, threshold=None):
    """timm's BinaryCrossEntropy.forward (loss/binary_cross_entropy.py:27-47 at cd638d5) with mixup's
    smoothed targets (mixup.py: mixup_target)."""
    classes = logits.shape[-1]
    if target.shape != logits.shape:
        off = smoothing / classes
        target = torch.full((target.shape[0], classes), off, dtype=logits.dtype).scatter_(
            1, target.long().view(-1, 1), 1 - smoothing + off)
    if threshold is not None:
        target = target.gt(threshold).to(logits.dtype)
    return F.binary_cross_entropy_with_logits(logits, target)


def test_bce_equals_timms_for_labels_mixed_targets_and_thresholds():
    torch.manual_seed(1)
    logits, labels = torch.randn(6, 5, dtype=torch.float64), torch.randint(0, 5, (6,))
    assert bce_loss(logits, labels) == pytest.approx(float(timm_bce(logits, labels)), rel=1e-12)
    assert bce_loss(logits, labels, 0.1) == pytest.approx(float(timm_bce(logits, labels, 0.1)), rel=1e-12)
    lam = 0.7
    one_hot = F.one_hot(labels, 5).double()
    mixed = lam * one_hot + (1 - lam) * one_hot.roll(1, 0)
    smoothed = lam * (one_hot * 0.9 + 0.02) + (1 - lam) * (one_hot.roll(1, 0) * 0.9 + 0.02)  # mixup_target, eps 0.1
    assert bce_loss(logits, mixed, 0.1) == pytest.approx(float(timm_bce(logits, smoothed)), rel=1e-12)
    assert bce_loss(logits, mixed, 0.0, 0.2) == pytest.approx(float(timm_bce(logits, mixed, threshold=0.2)), rel=1e-12)


def test_the_task_trains_with_bce_and_validates_with_cross_entropy():
    from hvdtrain.tasks.image_classification import ImageClassification

    cfg = load_config(None, ["optim.loss=bce"])
    task = ImageClassification(cfg)
    logits, labels = torch.randn(4, 3), torch.tensor([0, 1, 2, 0])
    assert task.loss(logits, labels, training=True) == pytest.approx(float(bce_loss(logits, labels)))
    assert task.loss(logits, labels, training=False) == pytest.approx(float(F.cross_entropy(logits, labels)))


# --- initialization and BlurPool ---------------------------------------------------------------------

def test_zero_init_residual_zeroes_each_blocks_last_batchnorm():
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="resnet50", zero_init_residual=True), 10)
    blocks = [m for m in model.modules() if isinstance(m, models.resnet.Bottleneck)]
    assert len(blocks) == 16 and all(torch.count_nonzero(b.bn3.weight) == 0 for b in blocks)
    assert all(torch.all(b.bn2.weight == 1) for b in blocks)
    small = build_model(ModelConfig(arch="resnet18", zero_init_residual=True), 10)
    basic = [b for b in small.modules() if isinstance(b, models.resnet.BasicBlock)]
    assert basic and all(torch.count_nonzero(b.bn2.weight) == 0 for b in basic)
    with pytest.raises(ConfigError, match="needs ResNet blocks"):
        build_model(ModelConfig(arch="squeezenet1_0", zero_init_residual=True), 10)


def test_conv_init_fan_in_and_fan_out():
    # layer4.0.conv3: 512 -> 2048 1x1, fan_in 512, fan_out 2048: Kaiming normal std sqrt(2 / fan).
    for mode, fan in (("fan_in", 512), ("fan_out", 2048)):
        torch.manual_seed(0)
        weight = build_model(ModelConfig(arch="resnet50", conv_init=mode), 10).layer4[0].conv3.weight
        assert float(weight.detach().std()) == pytest.approx(math.sqrt(2 / fan), rel=0.02), mode


def test_head_init_std_draws_the_classifier():
    torch.manual_seed(0)
    fc = build_model(ModelConfig(arch="resnet50", head_init_std=0.01), 1000).fc
    assert float(fc.weight.detach().std()) == pytest.approx(0.01, rel=0.02) and torch.count_nonzero(fc.bias) == 0


def test_blurpool_wraps_ffcvs_convolutions_and_blurs_first():
    model = build_model(ModelConfig(arch="resnet50", blurpool=True), 10)
    wrapped = sorted(name for name, m in model.named_modules() if isinstance(m, BlurPoolConv2d))
    # FFCV's rule (train_imagenet.py:335-340): stride > 1 and >= 16 input channels; not the 3-channel stem.
    assert wrapped == [f"layer{i}.0.{c}" for i in (2, 3, 4) for c in ("conv2", "downsample.0")]
    block = model.layer2[0].conv2
    x = torch.randn(1, block.conv.in_channels, 8, 8)
    kernel = torch.tensor([[1.0, 2, 1], [2, 4, 2], [1, 2, 1]]) / 16  # train_imagenet.py:118
    blurred = F.conv2d(x, kernel.expand(x.shape[1], 1, 3, 3), padding=1, groups=x.shape[1])
    assert torch.allclose(block(x), block.conv(blurred), atol=1e-6)
    assert "layer2.0.conv2.conv.weight" in model.state_dict() and not any("blur" in k for k in model.state_dict())
    assert model(torch.randn(2, 3, 64, 64)).shape == (2, 10)


# --- timm's RandAugment ---------------------------------------------------------------------------------

def test_timm_magnitude_scale_is_three_times_torchvisions_at_m6_of_31_bins():
    # timm auto_augment.py:32 (_LEVEL_DENOM = 10), :198-202 (shear 0.3), :178-182 (rotate 30 degrees).
    torch.manual_seed(0)
    assert abs(timm_op_argument("ShearX", 6, 160)) == pytest.approx(0.18)
    assert abs(timm_op_argument("Rotate", 6, 160)) == pytest.approx(18.0)
    assert abs(timm_op_argument("TranslateXRel", 10, 160)) == pytest.approx(0.45)
    assert timm_op_argument("PosterizeIncreasing", 6, 160) == 4 - int(0.6 * 4)
    assert timm_op_argument("SolarizeIncreasing", 6, 160) == 256 - int(0.6 * 256)
    assert "60% of the strongest: ShearX 0.18, Rotate 18 deg" in strength(
        AugmentConfig(policy="timm_randaugment", magnitude=6, magnitude_std=0.5, increasing_ops=True))
    assert "20% of the strongest: ShearX 0.06, Rotate 6 deg" in strength(
        AugmentConfig(policy="randaugment", magnitude=6, magnitude_bins=31))


def test_timm_randaugment_ops_probability_and_seeding():
    op = policy_ops(AugmentConfig(policy="timm_randaugment", magnitude=6, num_ops=2, magnitude_std=0.5,
                                  increasing_ops=True))
    assert isinstance(op, TimmRandAugment) and op.describe() == "timm rand-m6-n2-mstd0.5-inc1"
    assert "ColorIncreasing" in op.ops and "Color" not in op.ops and len(op.ops) == len(TIMM_OPS)
    image = torch.randint(0, 256, (3, 24, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    first = op(image)
    torch.manual_seed(3)
    assert torch.equal(op(image), first)
    # Each of the 2 ops applies with probability 0.5 (timm's AugmentOp(prob=0.5)): about a quarter of
    # the images pass unchanged (Invert, AutoContrast ... all change this random image).
    single = TimmRandAugment(6, num_ops=1)
    torch.manual_seed(0)
    unchanged = sum(torch.equal(single(image), image) for _ in range(400))
    assert 150 < unchanged < 250


def test_pil_affine_matches_pillows_transform():
    rng = np.random.default_rng(0)
    array = (rng.random((40, 48, 3)) * 255).astype(np.uint8)
    array = np.asarray(Image.fromarray(array).filter(ImageFilter.GaussianBlur(2)))  # smooth: filters agree
    tensor = torch.from_numpy(array.copy()).permute(2, 0, 1)
    for matrix in ((1, 0.18, 0, 0, 1, 0), (1, 0, 0, -0.18, 1, 0), (1, 0, 9.6, 0, 1, 0)):
        expected = Image.fromarray(array).transform((48, 40), Image.AFFINE, matrix, resample=Image.BILINEAR,
                                                    fillcolor=(124, 116, 104))
        actual = pil_affine(tensor, matrix, False, (124, 116, 104)).permute(1, 2, 0).numpy()
        assert np.abs(actual.astype(int) - np.asarray(expected).astype(int)).mean() < 2.0, matrix
    for degrees in (18.0, -18.0):  # timm's rotate: Pillow's Image.rotate (auto_augment.py:88-91)
        expected = Image.fromarray(array).rotate(degrees, resample=Image.BICUBIC, fillcolor=(124, 116, 104))
        actual = apply_timm_op(tensor, "Rotate", degrees, bicubic=True).permute(1, 2, 0).numpy()
        assert np.abs(actual.astype(int) - np.asarray(expected).astype(int)).mean() < 2.0, degrees


def test_every_timm_op_keeps_uint8_shape():
    image = torch.randint(0, 256, (3, 20, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    for name in TIMM_OPS + ("PosterizeIncreasing", "SolarizeIncreasing", "ColorIncreasing"):
        out = apply_timm_op(image, name, timm_op_argument(name, 6.0, 24), bicubic=True)
        assert out.dtype == torch.uint8 and out.shape == image.shape, name


# --- validation crop and filter ---------------------------------------------------------------------------

def test_val_crop_fraction_is_timms_floor_and_the_default_is_unchanged():
    assert val_resize_size(DataConfig(image_size=160, val_image_size=224, val_crop_fraction=0.95)) == 235
    assert val_resize_size(DataConfig(val_image_size=256, val_crop_fraction=0.875)) == 292
    assert val_resize_size(DataConfig()) == 256 and val_resize_size(DataConfig(val_image_size=256)) == 293


def test_bicubic_validation_matches_torchvisions_resize_and_center_crop():
    from hvdtrain.tools.bench_data import photo

    image = photo(np.random.default_rng(0), 500, 375)
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=95)
    data = buffer.getvalue()
    decoded = Image.open(io.BytesIO(data)).convert("RGB")
    transform = fast_eval_transform(DataConfig(image_size=224, val_crop_fraction=0.95, val_interpolation="bicubic"))
    reference = transforms.Compose([transforms.Resize(235, transforms.InterpolationMode.BICUBIC),
                                    transforms.CenterCrop(224), transforms.PILToTensor()])
    actual, expected = transform(data).float(), reference(decoded).float()
    assert (actual - expected).abs().mean() < 0.5
    bilinear = CenterCrop(224, 235)(data).float()
    assert (bilinear - expected).abs().mean() > (actual - expected).abs().mean()


# --- validation cadence ------------------------------------------------------------------------------------

def test_validation_every_n_epochs_with_an_offset_as_mxnets_fit():
    cfg = load_config(None, ["train.epochs=37", "eval.every_epochs=4", "eval.offset_epochs=2"])
    # NVIDIA MLPerf v2.0 common/fit.py:1022: epoch % eval_period == eval_offset (0-based); and the last.
    assert [e for e in range(37) if validates_after(cfg, e)] == [e for e in range(37) if e % 4 == 2] + [36]
    assert all(validates_after(load_config(None, ["train.epochs=5"]), e) for e in range(5))


def test_an_epoch_without_validation_checkpoints_and_logs_training_only(monkeypatch, capsys):
    import hvdtrain.train.outputs as run_module

    calls = []
    monkeypatch.setattr(run_module, "evaluate", lambda *a, **k: calls.append("evaluate") or {})
    # save_checkpoint calls on_saved once rank 0's write is done (None: nothing written here)
    monkeypatch.setattr(run_module, "save_checkpoint",
                        lambda *a, **k: calls.append("checkpoint") or k["on_saved"](None))
    monkeypatch.setattr(run_module, "audit_ranks", lambda *a, **k: None)
    monkeypatch.setattr(run_module, "add_rank_report", lambda *a, **k: None)
    written = []
    cfg = load_config(None, ["train.epochs=9", "eval.every_epochs=4", "eval.offset_epochs=2"])
    position = types.SimpleNamespace(step=40, start_epoch=lambda epoch: calls.append(f"start {epoch}"))
    run = types.SimpleNamespace(cfg=cfg, task=None, state=types.SimpleNamespace(model=torch.nn.Linear(1, 1),
                                                                                   position=position))
    outputs = types.SimpleNamespace(saver=None, tracker=None, writer=types.SimpleNamespace(write=written.append))
    train = {"loss": 1.5, "lr": 0.1, "seconds": 2.0, "stopped": False, "steps": 10}
    result = run_module.end_epoch(run, outputs, 0, train)
    assert result["val"] == {} and calls == ["start 1", "checkpoint"]
    assert [r["split"] for r in written] == ["train"] and "not validated" in capsys.readouterr().out


# --- config errors: one line ------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, words", [
    (["optim.warmup_start=0.1", "optim.warmup_start_lr=1e-4"], "set one of the two"),
    (["optim.warmup_start_lr=-0.5"], "optim.warmup_start_lr' is a rate >= 0"),
    (["optim.no_decay=names", "optim.no_decay_names=bn,"], "optim.no_decay_names'"),
    (["optim.bce_target_threshold=0.2"], "needs optim.loss=bce"),
    (["optim.lars_momentum_correction=true"], "needs optim.name=lars"),
    (["optim.lamb_max_grad_norm=1.0"], "needs optim.name=lamb"),
    (["model.head_init_std=-1"], "model.head_init_std' must be >= 0"),
    (["augment.policy=timm_randaugment", "augment.magnitude=11"], "timm's 0-10 scale"),
    (["augment.magnitude_std=0.5"], "need augment.policy=timm_randaugment"),
    (["data.val_crop_fraction=1.5"], "data.val_crop_fraction' must be in (0, 1]"),
    (["data.val_crop_fraction=0.9", "data.val_resize=256"], "set one of the two"),
    (["data.val_interpolation=bicubic", "data.decoder=nvimgcodec"], "needs the CPU decoder"),
    (["eval.every_epochs=4", "eval.offset_epochs=4"], "eval.offset_epochs (4) in [0, eval.every_epochs)"),
    (["optim.lr_step=epochs"], "optim.lr_step"),
])
def test_bad_settings_of_the_new_keys_get_one_line(overrides, words):
    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert words in str(error.value) and "\n" not in str(error.value)


# --- the start-up line --------------------------------------------------------------------------------------

def startup(name: str, ranks: int = 8) -> str:
    from hvdtrain.train.run import recipe_line

    cfg = load_config(name)
    global_batch = cfg.train.batch_size * ranks
    schedule = LRSchedule.from_config(cfg.optim, global_batch, cfg.train.epochs, 1281167 // global_batch)
    return recipe_line(cfg, build_model(cfg.model, 1000), schedule)


def test_startup_line_shows_warmup_exemption_augmentation_and_validation():
    nvidia = startup("nvidia_rn50_v15")
    assert "warm-up 0.256 (step 0) -> 2.048 (last warm-up step) -> peak 2.048" in nvidia
    assert "once per epoch, warm-up epochs at their end value, then cosine to 0" in nvidia
    assert "names containing 'bn' (98 tensors exempt; 9 of 107 1-d tensors decayed: fc.bias" in nvidia
    assert "validation 224 px center crop of 256 px (bilinear), every epoch" in nvidia
    timm = startup("timm_rsb_a3")
    assert "warm-up 0.0001 (step 0)" in timm and "over the whole run" in timm and "loss bce" in timm
    assert "timm rand-m6-n2-mstd0.5-inc1 (60% of the strongest: ShearX 0.18, Rotate 18 deg)" in timm
    assert "224 px center crop of 235 px (bicubic)" in timm
    mlperf = startup("mlperf_lars_rn50")
    assert "warm-up 0 (step 0)" in mlperf and "1 of 107 1-d tensors decayed: fc.bias" in mlperf
    assert "crop area 0.05,1.0" in mlperf and "after epochs 3, 7, ... and the last" in mlperf


def test_startup_line_says_the_rate_changes_only_where_it_does():
    """A warm-up and a cosine decay move the rate every step (or epoch); a step schedule only at its
    milestones, a constant rate never; a warm-up that starts at the peak is none."""
    from hvdtrain.optim.build import describe_schedule

    def said(*overrides: str, global_batch: int = 512) -> str:
        optim = load_config("debug", list(overrides)).optim
        return describe_schedule(optim, LRSchedule.from_config(optim, global_batch, 10, 100))

    assert said("optim.schedule=constant", "optim.lr=0.05", "optim.warmup_epochs=0") == \
        "no warm-up: peak 0.05 from step 0, then constant to the end"
    assert said("optim.schedule=constant", "optim.lr=0.05", "optim.warmup_epochs=2", "optim.warmup_start=0") == \
        ("warm-up 0 (step 0) -> 0.04975 (last warm-up step) -> peak 0.05, rate changes every step in the warm-up, "
         "then constant to the end")
    assert said("optim.schedule=step", "optim.base_lr=0.1", "optim.warmup_epochs=5", "optim.warmup_start=-1",
                "optim.step_milestones=6,8", "optim.lr_step=epoch") == \
        ("warm-up 0.1 (step 0) -> 0.18 (last warm-up step) -> peak 0.2, rate changes once per epoch in the warm-up, "
         "then step x0.1 at epochs 6, 8 (fixed)")
    # Goyal et al. at a global batch of 256: the warm-up would start at the peak.
    assert said("optim.schedule=step", "optim.base_lr=0.1", "optim.warmup_epochs=5", "optim.warmup_start=-1",
                "optim.step_milestones=6,8", global_batch=256) == \
        "no warm-up: peak 0.1 from step 0, then step x0.1 at epochs 6, 8 (fixed)"
    assert said("optim.schedule=cosine", "optim.lr=0.05", "optim.warmup_epochs=0", "optim.end_lr=0") == \
        "no warm-up: peak 0.05 from step 0, then cosine to 0, rate changes every step"


# --- pytorch/examples' imagenet/main.py ------------------------------------------------------------

def test_main_py_preset_keeps_its_rate_at_any_number_of_ranks_and_steps_every_30_epochs():
    """main.py's --lr is never scaled, and StepLR steps every 30 epochs whatever --epochs says."""
    for ranks in (1, 2, 8, 256):
        cfg = load_config("pytorch_examples")
        assert TABLES.resolve(cfg, "lr.peak", ranks) == 0.1
        assert TABLES.resolve(cfg, "train.batch_size", ranks) * ranks == 256
    short = load_config("pytorch_examples", ["train.epochs=3"])
    schedule = LRSchedule.from_config(short.optim, 256, 3, 23)
    assert [lr_at(step, schedule) for step in (0, 22, 23, 68)] == [0.1] * 4  # no step within 3 epochs
    from hvdtrain.train.run import recipe_line

    line = recipe_line(load_config("pytorch_examples"), models.resnet18(),
                       LRSchedule.from_config(load_config("pytorch_examples").optim, 256, 90, 5005))
    assert line.startswith("no warm-up: peak 0.1 from step 0, then step x0.1 every 30 epochs (at 30, 60 of 90); ")
    assert "weight decay 0.0001 on every parameter (62 tensors, 41 of them 1-d)" in line
    assert "validation 224 px center crop of 256 px (bilinear), every epoch" in line


def test_from_ddp_maps_main_py_batch_by_how_it_was_started():
    """main.py's -b is the node's batch when it spawns its processes (--multiprocessing-distributed
    divides it by the GPUs) and each process's own under torchrun (no --gpu: nothing divides it): two
    rows, two keys; the torchrun one lifts the preset's global batch, which an explicit per-rank batch
    would contradict."""
    text = (ROOT / "docs" / "from-ddp.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `-b N`")]
    assert len(rows) == 2, rows
    spawned, torchrun = rows
    assert "--multiprocessing-distributed" in spawned and "`train.global_batch_size=N`" in spawned
    assert "under `torchrun`" in torchrun and "`train.batch_size=N`" in torchrun
    assert "`train.global_batch_size=0`" in torchrun
    cfg = load_config("pytorch_examples", ["train.global_batch_size=0", "train.batch_size=256"])
    assert (cfg.train.global_batch_size, cfg.train.batch_size) == (0, 256)


def test_from_ddp_maps_main_py_to_keys_that_exist():
    """Every key the main.py section of docs/from-ddp.md gives (`section.key=value`) is a real key
    that takes that value."""
    import re

    text = (ROOT / "docs" / "from-ddp.md").read_text()
    section = text.split("## From pytorch/examples' imagenet/main.py", 1)[1].split("\n## ", 1)[0]
    settings = set(re.findall(r"`([a-z_]+\.[a-z_.]+=[^` ]+)`", section))
    assert len(settings) >= 15, settings
    placeholders = {"N": "2", "LR": "0.2", "M": "0.5", "W": "0.001", "ARCH": "resnet34", "DIR": "/data",
                    "PATH": "runs/x/checkpoints/last.pt"}
    for setting in sorted(settings):
        key, value = setting.split("=", 1)
        load_config(None, [f"{key}={placeholders.get(value, value)}"])  # an unknown key or a bad value raises


# --- Horovod's examples/pytorch/pytorch_imagenet_resnet50.py ------------------------------------------

def horovod_example_source() -> Path:
    """The unchanged copy of Horovod's example in ../shared/peers (beside the checkout or a folder
    above it); the test that needs it skips, saying so, where there is none."""
    for folder in ROOT.parents:
        path = folder / "shared" / "peers" / "horovod" / "pytorch_imagenet_resnet50.py"
        if path.is_file():
            return path
    pytest.skip("no copy of Horovod's pytorch_imagenet_resnet50.py in ../shared/peers/horovod: "
                "the preset's rows are checked against published.json only")


def cited_lines(cite: str) -> list[int]:
    """The line numbers of a cite such as 'repo@commit path:26, 270-278'."""
    numbers = []
    for part in cite.rsplit(":", 1)[1].split(","):
        first, _, last = part.strip().partition("-")
        numbers += range(int(first), int(last or first) + 1)
    return numbers


def test_every_horovod_example_row_quotes_its_cited_lines():
    """Each row's quote is in the lines it cites, in the unchanged example: a row that cites the
    wrong line, or a copy of another version of the example, fails here."""
    lines = horovod_example_source().read_text().splitlines()
    rows = PUBLISHED["horovod_example"]["rows"]
    assert all(row.get("quote") and "pytorch_imagenet_resnet50.py:" in row["cite"] for row in rows)
    wrong = [f"{row['name']}: {row['quote']!r} not in {row['cite']}" for row in rows
             if row["quote"] not in "\n".join(lines[n - 1] for n in cited_lines(row["cite"]))]
    assert not wrong, "\n".join(wrong)


def test_horovod_example_preset_has_the_examples_argument_defaults():
    """The example's argparse defaults, read from its source (not run), against the keys the preset
    resolves to (docs/from-ddp.md's table maps each flag)."""
    import ast

    defaults = {}
    for node in ast.walk(ast.parse(horovod_example_source().read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            flag = node.args[0].value.lstrip("-").replace("-", "_")
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            if isinstance(default, ast.Constant):
                defaults[flag] = default.value
    cfg = load_config("horovod_example")
    ours = {"batch_size": cfg.train.batch_size, "val_batch_size": cfg.train.batch_size,
            "epochs": cfg.train.epochs, "base_lr": cfg.optim.lr_per_rank,
            "warmup_epochs": cfg.optim.warmup_epochs, "momentum": cfg.optim.momentum,
            "wd": cfg.optim.weight_decay, "seed": cfg.seed,
            "batches_per_allreduce": cfg.train.backward_passes_per_step,
            "gradient_predivide_factor": cfg.dist.gradient_predivide_factor,
            "fp16_allreduce": cfg.dist.compression == "fp16", "use_adasum": cfg.dist.op == "adasum",
            "no_cuda": False, "checkpoint_format": "./checkpoint-{epoch}.pth.tar", "log_dir": "./logs"}
    assert set(defaults) == set(ours), sorted(defaults)  # --train-dir, --val-dir: data.dir
    assert {flag: defaults[flag] for flag in ours} == ours


@pytest.mark.parametrize("ranks, passes", [(8, 1), (2, 1), (4, 2)])
def test_horovod_example_preset_steps_at_the_examples_rates(ranks, passes):
    """Every step's rate of 90 epochs is the example's adjust_learning_rate at any number of ranks:
    equal after the warm-up, and one step earlier in it (the example sets the rate for the position
    after the step)."""
    from tests.unit.test_lr import horovod_example_lr

    cfg = load_config("horovod_example", [f"train.backward_passes_per_step={passes}"] +
                      (["train.drop_last=true"] if passes > 1 else []))
    steps = 50
    schedule = LRSchedule.from_config(cfg.optim, 32 * ranks * passes, cfg.train.epochs, steps,
                                      rank_batch=32, passes=passes)
    for step in range(0, 90 * steps, 7):
        example = horovod_example_lr(step // steps, step % steps, 0.0125, ranks, passes, steps)
        ours = lr_at(step + 1 if step < 5 * steps else step, schedule)
        assert ours == pytest.approx(example, rel=1e-12), step
    assert lr_at(0, schedule) == pytest.approx(0.0125 * passes)  # the warm-up starts at one rank's rate
    # The milestones stay at 30, 60 and 80 in a shorter run, as the example's are.
    short = LRSchedule.from_config(load_config("horovod_example", ["train.epochs=40"]).optim, 256, 40, steps,
                                   rank_batch=32)
    assert lr_at(29 * steps, short) == pytest.approx(0.1) and lr_at(30 * steps, short) == pytest.approx(0.01)


def test_horovod_example_differs_from_imagenet_resnet50_where_the_example_does():
    """The likely-looking Goyal preset differs from the example in these settings, which the
    example's preset sets as the example does."""
    goyal, example = load_config("imagenet_resnet50"), load_config("horovod_example")
    differences = {
        "seed": (0, 42),
        "optim.nesterov": (True, False),
        "optim.weight_decay": (1e-4, 5e-5),
        "optim.no_decay": ("norm", "none"),
        "model.zero_init_residual": (True, False),
        "model.head_init_std": (0.01, 0.0),
        "train.drop_last": (True, False),
        "optim.step_milestones": ("", "30,60,80"),
    }
    for key, (theirs, ours) in differences.items():
        assert (TABLES.resolve(goyal, key, 8), TABLES.resolve(example, key, 8)) == (theirs, ours), key
    assert TABLES.resolve(example, "lr.warmup_start", 8) == 0.0125 != TABLES.resolve(goyal, "lr.warmup_start", 8)
