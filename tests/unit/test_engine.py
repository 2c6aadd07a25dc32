"""The engine in-process at world size 1: one step, accumulation, clipping and the GradScaler order,
each against the same arithmetic written out by hand (float64, so equal means equal)."""

from __future__ import annotations

import copy

import pytest
import torch

from hvdtrain.comm import dist
from hvdtrain.config import Config
from hvdtrain.optim.build import LRSchedule
from hvdtrain.tasks import Task
from hvdtrain.train.engine import Epoch, StepSettings, evaluate
from hvdtrain.train.state import RunState

LR = 0.05


class Regression(Task):
    """The smallest task: (x, y) batches, a linear model, mean squared error."""

    name = "regression"
    sum_fields = ("loss_sum", "count")

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(3, 1).double()

    def to_device(self, batch, device, dtype):
        x, y = batch
        return x.to(device, dtype), y.to(device, dtype)

    def loss(self, outputs, targets, training):
        return torch.nn.functional.mse_loss(outputs, targets)

    def metric_sums(self, loss, outputs, targets):
        return torch.stack([loss.double() * len(targets), torch.tensor(float(len(targets)), dtype=torch.float64)])

    def summarize(self, sums):
        return {"loss": float(sums[0] / sums[1]), "samples": int(sums[1])}


def batches(count: int, size: int = 4, scale: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    return [(torch.randn(size, 3, generator=generator, dtype=torch.float64) * scale,
             torch.randn(size, 1, generator=generator, dtype=torch.float64)) for _ in range(count)]


def make(passes: int = 1, clip: float = 0.0, scaler: torch.amp.GradScaler | None = None,
         distributed: bool = False) -> tuple[RunState, StepSettings]:
    torch.manual_seed(0)
    task = Regression(Config())
    model = task.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    if distributed:
        dist.init(gpu=False)
        optimizer = dist.distributed_optimizer(optimizer, model.named_parameters(), compression="none",
                                               backward_passes_per_step=passes, op="average")
        assert dist.is_distributed(optimizer)  # so the engine takes Horovod's synchronize protocol
    else:
        assert not dist.is_distributed(optimizer)
    settings = StepSettings(task=task, device=torch.device("cpu"), lr_schedule=constant_schedule(), dtype=torch.float64,
                            clip_grad_norm=clip, backward_passes_per_step=passes)
    return RunState(model, optimizer, scaler), settings


def constant_schedule() -> LRSchedule:
    """LR at every step of the first epoch (no warm-up; the first decay is 300 epochs away)."""
    return LRSchedule(peak_lr=LR, start_lr=LR, warmup_epochs=0, epochs=900, steps_per_epoch=1000)


def by_hand(model: torch.nn.Module, groups: list[list[tuple[torch.Tensor, torch.Tensor]]],
            clip: float = 0.0) -> torch.nn.Module:
    """Plain SGD on the mean loss of each group of batches."""
    model = copy.deepcopy(model)
    for group in groups:
        loss = sum(torch.nn.functional.mse_loss(model(x), y) for x, y in group) / len(group)
        model.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return model


def train_epoch(state, settings, data, steps, allreduce_sum, should_stop=None) -> dict:
    """An epoch as the trainer runs one (``Epoch.run``, the loop production runs take), then its
    metrics; ``should_stop`` is asked at every step boundary with steps left."""
    epoch = Epoch(state, settings, data, steps, allreduce_sum)
    epoch.run(should_stop=(lambda first: should_stop()) if should_stop is not None else None)
    return epoch.metrics()


def assert_same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "horovod-size-1"])
def test_steps_and_metrics_match_sgd_by_hand(distributed):
    state, settings = make(distributed=distributed)
    expected = by_hand(state.model, [[b] for b in batches(3)])
    metrics = train_epoch(state, settings, batches(3), 3, dist.allreduce_sum if distributed else lambda t: t)
    assert_same(state.model, expected)
    assert (state.position.step, state.position.step_in_epoch, metrics["steps"]) == (3, 3, 3)
    assert metrics["samples"] == 12 and metrics["stopped"] is False
    assert metrics["lr"] == pytest.approx(LR)


def test_every_step_run_is_timed_by_phase():
    state, settings = make()
    phases = train_epoch(state, settings, batches(3), 3, lambda t: t)["rank_phases"]
    assert phases["steps"] == 3
    assert set(phases) == {"data", "compute", "allreduce", "optimizer", "other", "steps"}
    assert all(phases[p] >= 0 for p in phases) and phases["compute"] > 0
    settings.phase_timing = False
    state.position.step_in_epoch = 0
    assert train_epoch(state, settings, batches(3), 3, lambda t: t)["rank_phases"]["steps"] == 0


def test_resumes_from_the_step_in_epoch_and_stops_when_asked():
    state, settings = make()
    state.position.step_in_epoch = 1  # one step of this epoch already done
    metrics = train_epoch(state, settings, batches(3), 3, lambda t: t)
    assert metrics["steps"] == 2 and state.position.step == 2
    state.position.step_in_epoch = 0
    asked = iter([False, True])
    metrics = train_epoch(state, settings, batches(3), 3, lambda t: t, should_stop=lambda: next(asked))
    assert metrics["stopped"] is True and metrics["steps"] == 1


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "horovod-size-1"])
def test_accumulation_averages_the_passes_of_a_step(distributed):
    state, settings = make(passes=2, distributed=distributed)
    data = batches(4)
    expected = by_hand(state.model, [data[0:2], data[2:4]])
    train_epoch(state, settings, data, 2, lambda t: t)
    assert_same(state.model, expected)
    assert state.position.step == 2


def test_clipping_limits_the_global_gradient_norm():
    state, settings = make(clip=0.01)
    data = batches(2, scale=100.0)  # gradients far above the limit
    expected = by_hand(state.model, [[b] for b in data], clip=0.01)
    before = [p.detach().clone() for p in state.model.parameters()]
    train_epoch(state, settings, data[:1], 1, lambda t: t)
    moved = torch.cat([(p.detach() - b).flatten() for p, b in zip(state.model.parameters(), before)])
    assert moved.norm().item() == pytest.approx(LR * 0.01, rel=1e-9)
    train_epoch(state, settings, data[1:], 2, lambda t: t)  # step 2 of the epoch
    assert_same(state.model, expected)


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "horovod-size-1"])
def test_gradscaler_unscales_before_clipping(distributed):
    # A scaled loss clipped before unscaling would take a step 2**10 times too small.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    state, settings = make(clip=0.01, scaler=scaler, distributed=distributed)
    data = batches(2, scale=100.0)
    expected = by_hand(state.model, [[b] for b in data], clip=0.01)
    train_epoch(state, settings, data, 2, lambda t: t)
    assert_same(state.model, expected)
    assert scaler.get_scale() == 2.0 ** 10  # finite gradients: the scale stays until growth_interval


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "horovod-size-1"])
def test_gradscaler_skips_a_step_with_infinite_gradients(distributed):
    # With Horovod the skipped step must still have synchronized (else zero_grad refuses to run).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    state, settings = make(scaler=scaler, distributed=distributed)
    before = [p.detach().clone() for p in state.model.parameters()]
    x, y = batches(1)[0]
    x[0, 0] = float("inf")
    train_epoch(state, settings, [(x, y)], 1, lambda t: t)
    for p, b in zip(state.model.parameters(), before):
        assert torch.equal(p.detach(), b)
    assert scaler.get_scale() == 2.0 ** 9 and state.position.step == 1


def test_evaluate_sums_every_batch_exactly():
    state, settings = make()
    data = batches(3, size=5)
    metrics = evaluate(state, settings, data, lambda t: t)
    with torch.no_grad():
        losses = [torch.nn.functional.mse_loss(state.model(x), y).item() for x, y in data]
    assert metrics["samples"] == 15
    assert metrics["loss"] == pytest.approx(sum(losses) / 3, rel=1e-12)
