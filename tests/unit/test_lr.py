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


# --- the step schedule at fixed epochs (torch's StepLR and MultiStepLR) ----------------------------

def torch_rates(make_scheduler, epochs: int, lr: float = 0.1) -> list[float]:
    """The rate of each epoch under one of torch's own schedulers, stepped once per epoch as
    pytorch/examples' imagenet/main.py steps its StepLR (after the epoch's training)."""
    import torch

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = make_scheduler(optimizer)
    rates = []
    for _ in range(epochs):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def fixed_step(epochs: int, steps: int, **optim) -> LRSchedule:
    return LRSchedule.from_config(OptimConfig(lr=0.1, warmup_epochs=0, schedule="step", **optim), 256, epochs, steps)


@pytest.mark.parametrize("epochs", [90, 3, 100])
def test_step_every_epochs_is_torchs_steplr_whatever_the_run_length(epochs):
    from torch.optim.lr_scheduler import StepLR

    expected = torch_rates(lambda opt: StepLR(opt, step_size=30, gamma=0.1), epochs)
    sched = fixed_step(epochs, 23, step_every_epochs=30)
    for epoch in range(epochs):
        for step in (epoch * 23, epoch * 23 + 11, epoch * 23 + 22):  # constant through each epoch
            assert lr_at(step, sched) == pytest.approx(expected[epoch], rel=1e-12), (epoch, step)
    assert sched.step_milestones() == tuple(float(e) for e in range(30, epochs, 30))


def test_step_milestones_are_torchs_multisteplr_and_do_not_scale():
    from torch.optim.lr_scheduler import MultiStepLR

    for epochs in (90, 40):
        expected = torch_rates(lambda opt: MultiStepLR(opt, milestones=[30, 60, 80], gamma=0.5), epochs)
        sched = fixed_step(epochs, 10, step_milestones="30,60,80", step_gamma=0.5)
        assert [lr_at(e * 10, sched) for e in range(epochs)] == pytest.approx(expected, rel=1e-12)
    # The default still scales 30/60/80 of 90 to the run's length.
    assert fixed_step(9, 10).step_milestones() == pytest.approx((3.0, 6.0, 8.0))
    assert lr_at(30, fixed_step(9, 10)) == pytest.approx(0.01)


def test_step_schedule_after_a_warmup_counts_epochs_from_zero():
    sched = LRSchedule.from_config(OptimConfig(lr=0.4, warmup_epochs=2, warmup_start=0.0, schedule="step",
                                               step_every_epochs=3), 1024, 10, 10)
    assert [lr_at(e * 10, sched) for e in range(8)] == pytest.approx([0, 0.2, 0.4, 0.04, 0.04, 0.04, 0.004, 0.004])


@pytest.mark.parametrize("overrides, words", [
    (["optim.step_every_epochs=30", "optim.step_milestones=30,60"], "set one of the two"),
    (["optim.step_milestones=60,30"], "positive epochs in increasing order"),
    (["optim.step_milestones=30,x"], "expected epochs separated by commas"),
    (["optim.step_every_epochs=-1"], "optim.step_every_epochs' must be >= 0"),
    (["optim.step_gamma=0"], "optim.step_gamma' must be positive"),
    (["optim.schedule=cosine", "optim.step_every_epochs=30"], "needs optim.schedule=step, got cosine"),
    (["optim.schedule=poly", "optim.step_gamma=0.5"], "optim.step_gamma is a setting of the step schedule"),
])
def test_bad_step_settings_get_one_line(overrides, words):
    from hvdtrain.config import ConfigError
    from hvdtrain.job_config import load_config

    with pytest.raises(ConfigError) as error:
        load_config(None, overrides)
    assert words in str(error.value) and "\n" not in str(error.value)


def horovod_example_lr(epoch: int, batch_idx: int, base_lr: float, size: int, batches_per_allreduce: int,
                       steps: int, warmup_epochs: float = 5) -> float:
    """Horovod's examples/pytorch/pytorch_imagenet_resnet50.py, adjust_learning_rate (its --base-lr is
    the rate for one GPU's batch), re-implemented from the example's source."""
    if epoch < warmup_epochs:
        epoch += float(batch_idx + 1) / steps
        lr_adj = 1. / size * (epoch * (size - 1) / warmup_epochs + 1)
    elif epoch < 30:
        lr_adj = 1.
    elif epoch < 60:
        lr_adj = 1e-1
    elif epoch < 80:
        lr_adj = 1e-2
    else:
        lr_adj = 1e-3
    return base_lr * size * batches_per_allreduce * lr_adj


@pytest.mark.parametrize("size, passes", [(8, 1), (4, 2)])
def test_lr_per_rank_is_horovods_example_base_lr(size, passes):
    """optim.lr_per_rank=0.0125 at 32 images per rank: the example's --base-lr 0.0125, the same rates
    as optim.base_lr=0.1 per 256 images after the warm-up, warmed up from the one-rank rate."""
    steps = 40
    optim = OptimConfig(lr_per_rank=0.0125, warmup_epochs=5, schedule="step", step_milestones="30,60,80")
    sched = LRSchedule.from_config(optim, 32 * size * passes, 90, steps, rank_batch=32, passes=passes)
    per_256 = LRSchedule.from_config(OptimConfig(base_lr=0.1, warmup_epochs=5, schedule="step",
                                                 step_milestones="30,60,80"), 32 * size * passes, 90, steps)
    assert sched.peak_lr == pytest.approx(0.0125 * size * passes) == pytest.approx(per_256.peak_lr)
    assert sched.start_lr == pytest.approx(0.0125 * passes)
    for epoch in (5, 29, 30, 59, 60, 80, 89):
        for batch in (0, steps - 1):
            assert lr_at(epoch * steps + batch, sched) == pytest.approx(
                horovod_example_lr(epoch, batch, 0.0125, size, passes, steps)), (epoch, batch)
    # In the warm-up the example sets the rate for the position after the step, hvdtrain before it: one step apart.
    for step in range(0, 5 * steps, 7):
        assert lr_at(step + 1, sched) == pytest.approx(
            horovod_example_lr(step // steps, step % steps, 0.0125, size, passes, steps)), step


def test_the_start_up_line_gives_the_rate_in_both_units():
    from hvdtrain.config import ConfigError
    from hvdtrain.job_config import load_config
    from hvdtrain.train.run import rate_note

    assert rate_note(load_config("debug"), 16, 16, 2) == " (optim.base_lr 0.4 per 256 images = 0.0125 for one rank's 8)"
    per_rank = load_config("debug", ["optim.lr_per_rank=0.0125"])
    assert rate_note(per_rank, 16, 16, 2) == " (optim.lr_per_rank 0.0125 for one rank's 8 images = 0.4 per 256)"
    assert rate_note(load_config("debug", ["optim.lr=0.05"]), 16, 16, 2) == ""  # a rate as it is
    with pytest.raises(ConfigError, match=r"^optim.lr=0.05 and optim.lr_per_rank=0.0125 both set the rate: set one"):
        load_config("debug", ["optim.lr=0.05", "optim.lr_per_rank=0.0125"])
