import math

import pytest

from hvdtrain.config import OptimConfig
from hvdtrain.optim.build import LRSchedule, lr_at, param_groups, scaled_lr

IMAGENET_TRAIN = 1281167


def goyal(global_batch, schedule="step", epochs=90):
    steps = math.ceil(IMAGENET_TRAIN / global_batch)
    return LRSchedule.from_config(OptimConfig(base_lr=0.1, warmup_epochs=5, schedule=schedule), global_batch,
                                  epochs, steps), steps


def test_linear_scaling_rule():
    # Goyal et al. 2017: eta = 0.1 * kn / 256; kn = 8192 gives 3.2.
    assert scaled_lr(0.1, 256) == pytest.approx(0.1)
    assert scaled_lr(0.1, 8192) == pytest.approx(3.2)
    assert scaled_lr(0.1, 32 * 16) == pytest.approx(0.2)


def test_gradual_warmup_from_reference_rate_to_scaled_rate():
    sched, steps = goyal(8192)
    assert lr_at(0, sched) == pytest.approx(0.1)                  # starts at eta
    assert lr_at(5 * steps, sched) == pytest.approx(3.2)           # reaches k * eta after 5 epochs
    halfway = lr_at(int(2.5 * steps), sched)
    assert halfway == pytest.approx(0.1 + 3.1 * (int(2.5 * steps) / steps) / 5)
    increments = [lr_at(s + 1, sched) - lr_at(s, sched) for s in range(0, 5 * steps - 1, 97)]
    assert max(increments) == pytest.approx(min(increments))      # a constant amount per iteration


def test_step_decay_at_30_60_80_of_90():
    sched, steps = goyal(8192)
    for epoch, expected in ((10, 3.2), (29.99, 3.2), (30, 0.32), (59, 0.32), (60, 0.032), (80, 0.0032),
                            (89.9, 0.0032)):
        assert lr_at(math.ceil(epoch * steps), sched) == pytest.approx(expected), epoch


def test_step_milestones_scale_with_epoch_count():
    # 9 epochs: milestones at epochs 3, 6 and 8.
    sched = LRSchedule(peak_lr=1.0, start_lr=1.0, warmup_epochs=0, epochs=9, steps_per_epoch=10)
    assert [lr_at(s, sched) for s in (29, 30, 59, 60, 79, 80)] == pytest.approx([1, 0.1, 0.1, 0.01, 0.01, 0.001])


def test_small_global_batch_never_warms_down():
    sched, _ = goyal(64)
    assert sched.start_lr == sched.peak_lr == pytest.approx(0.025)


def test_cosine_after_warmup():
    sched = LRSchedule(peak_lr=2.0, start_lr=0.5, warmup_epochs=2, epochs=12, steps_per_epoch=100,
                       schedule="cosine")
    assert lr_at(0, sched) == pytest.approx(0.5)
    assert lr_at(100, sched) == pytest.approx(1.25)
    assert lr_at(200, sched) == pytest.approx(2.0)
    assert lr_at(700, sched) == pytest.approx(1.0)   # halfway through the decay
    assert lr_at(1200, sched) == pytest.approx(0.0, abs=1e-12)


def test_no_weight_decay_on_biases_and_norms():
    import torch

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.LazyLinear(2))
    model(torch.zeros(1, 3, 5, 5))
    decay, no_decay = param_groups(model, 1e-4)
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    assert sorted(p.ndim for p in decay["params"]) == [2, 4]
    assert len(no_decay["params"]) == 4  # conv bias, BN weight and bias, linear bias


def test_warmup_start_as_a_fraction_of_the_peak():
    # Below a global batch of 256 the Goyal warm-up starts at the peak (nothing to warm up); a
    # warm-up from zero (NVIDIA, MLPerf) or from a fraction of the peak is optim.warmup_start.
    for fraction, first in ((0.0, 0.0), (0.1, 0.01), (-1.0, 0.1)):
        sched = LRSchedule.from_config(OptimConfig(base_lr=0.4, warmup_epochs=2, warmup_start=fraction,
                                                   schedule="cosine"), 64, 8, 10)
        assert sched.peak_lr == pytest.approx(0.1) and lr_at(0, sched) == pytest.approx(first)
        assert lr_at(10, sched) == pytest.approx((first + 0.1) / 2) and lr_at(20, sched) == pytest.approx(0.1)
