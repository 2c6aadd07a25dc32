"""The audit's fingerprint: one flipped bit in any parameter, buffer, optimizer state tensor,
hyperparameter or GradScaler value changes it, the first differing entry is named with the ranks
that differ, and floating buffers are left out mid-epoch (each rank's BatchNorm statistics are its
own until the epoch end averages them)."""

from __future__ import annotations

import copy

import torch

from hvdtrain.fault.audit import compare, fingerprint, tensor_print
from hvdtrain.train.state import RunState


def small_state(scaler: bool = False) -> RunState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    optimizer.step()
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaler else None
    return RunState(model, optimizer, grad_scaler)


def flip_lowest_bit(tensor: torch.Tensor) -> None:
    with torch.no_grad():
        tensor.view(torch.int32).view(-1)[3] ^= 1


def first_difference(a: RunState, b: RunState, floating_buffers: bool = True):
    names, first = fingerprint(a, floating_buffers)
    names_b, second = fingerprint(b, floating_buffers)
    assert names == names_b
    return compare(names, [first, first.clone(), second])


def test_identical_states_agree():
    assert first_difference(small_state(), small_state()) is None


def test_one_flipped_bit_in_a_parameter_is_named_with_the_rank():
    a, b = small_state(), small_state()
    flip_lowest_bit(b.model[3].weight)
    assert first_difference(a, b) == ("parameter 3.weight", [2], 1)


def test_buffers_optimizer_state_hyperparameters_and_the_scaler_count():
    a = small_state(scaler=True)
    for change, name in (
        (lambda s: s.model[1].running_var.add_(1e-6), "buffer 1.running_var"),
        (lambda s: s.model[1].num_batches_tracked.add_(1), "buffer 1.num_batches_tracked"),
        (lambda s: flip_lowest_bit(s.optimizer.state[s.model[0].weight]["momentum_buffer"]),
         "optimizer momentum_buffer of 0.weight"),
        (lambda s: s.optimizer.param_groups[0].update(lr=0.1 + 1e-12), "optimizer group 0 lr"),
        (lambda s: s.scaler.load_state_dict({**s.scaler.state_dict(), "scale": 512.0}), "GradScaler scale"),
        (lambda s: setattr(s.position, "step", 7), "position step"),
    ):
        b = small_state(scaler=True)
        with torch.no_grad():
            change(b)
        found = first_difference(a, b)
        assert found is not None and found[0] == name, (name, found)


def test_floating_buffers_are_left_out_mid_epoch():
    a, b = small_state(), small_state()
    with torch.no_grad():
        b.model[1].running_mean.add_(0.5)
    assert first_difference(a, b, floating_buffers=False) is None
    assert first_difference(a, b, floating_buffers=True)[0] == "buffer 1.running_mean"


def test_the_print_is_exact_and_sees_every_element():
    values = torch.randn(1000)
    other = values.clone()
    other[999] = torch.nextafter(other[999], torch.tensor(10.0))
    assert tensor_print(values) != tensor_print(other)
    assert tensor_print(values) == tensor_print(copy.deepcopy(values))
    assert tensor_print(torch.tensor([True, False])) == 1
    assert tensor_print(values.double()) != tensor_print(other.double())
