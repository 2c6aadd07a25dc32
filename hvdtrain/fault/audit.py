"""A cross-rank consistency audit: every rank must hold the same model, optimizer and GradScaler.

Data-parallel training keeps N copies of one model that never meet again after the first
broadcast: each rank applies the same averaged gradients to its own copy. A non-deterministic op
in the optimizer, a rank that skipped a GradScaler step the others took, or a buffer the broadcast
missed makes the copies drift apart without any error; the checkpoint then saves rank 0's copy and
the accuracy of the others is lost. The audit catches it where it starts.

Each rank takes a fingerprint of its state: per tensor, the sum of its elements' bit patterns read
as integers (int64 arithmetic, exact and order-free, so one flipped bit anywhere changes it), and
the optimizer's hyperparameters and the position, as numbers. The fingerprints are gathered (a
few hundred integers per rank) and compared with rank 0's; the first tensor that differs is named
with the ranks that differ. It runs at every checkpoint and at every epoch end (after BatchNorm
statistics are averaged), and every ``runtime.audit_every`` steps when set.

Mid-epoch, each rank's floating buffers (BatchNorm running statistics) follow its own shard until
the epoch end averages them: they are left out then. Under Horovod's Adasum (``dist.op=adasum``)
each rank's optimizer state (momentum) follows its own gradients, and only the weights it reaches
are combined: the optimizer's state tensors are left out (``optimizer_state=False``).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..comm import dist

# Integer types of the same width as each element size: a tensor's bits are viewed through them.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_print(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of the tensor's elements' bit patterns as a 0-d int64 tensor on its device."""
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    if tensor.dtype == torch.bool:
        tensor = tensor.view(torch.uint8)
    if tensor.is_floating_point():
        tensor = tensor.view(_BITS[tensor.element_size()])
    return tensor.sum(dtype=torch.int64)


def number_print(value: float | int | bool) -> int:
    """A plain number as an int64 (a float by its bits, so that 0.1 and 0.1 + 1e-17 differ)."""
    if isinstance(value, int):  # bool too
        return int(value)
    return int(torch.tensor(float(value), dtype=torch.float64).view(torch.int64))


class AuditedState(Protocol):
    """What the audit reads of a run's state (train/state.py's RunState has it; the audit, below the
    training loop, does not import it): the model, its optimizer, the GradScaler (None without AMP)
    and the position (``epoch``, ``step``, ``step_in_epoch``, ``samples_in_epoch``)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scaler: Any
    position: Any


def fingerprint(state: AuditedState, floating_buffers: bool,
                optimizer_state: bool = True) -> tuple[list[str], torch.Tensor]:
    """(names, int64 fingerprints): parameters, buffers (floating ones only with
    ``floating_buffers``), optimizer state tensors (with ``optimizer_state``) and hyperparameters,
    GradScaler state, position."""
    names: list[str] = []
    device_prints: list[torch.Tensor] = []
    numbers: list[tuple[str, int]] = []
    model = state.model
    param_names = {id(p): name for name, p in model.named_parameters()}
    for name, param in model.named_parameters():
        names.append(f"parameter {name}")
        device_prints.append(tensor_print(param))
    for name, buffer in model.named_buffers():
        if buffer.is_floating_point() and not floating_buffers:
            continue
        names.append(f"buffer {name}")
        device_prints.append(tensor_print(buffer))
    optimizer = state.optimizer
    for index, group in enumerate(optimizer.param_groups):
        for key, value in sorted(group.items()):
            if key == "params" or not isinstance(value, (int, float)):
                continue
            numbers.append((f"optimizer group {index} {key}", number_print(value)))
        for param in group["params"]:
            for key, value in sorted(optimizer.state.get(param, {}).items()):
                label = f"optimizer {key} of {param_names.get(id(param), 'an unnamed parameter')}"
                if isinstance(value, torch.Tensor):
                    if not optimizer_state:
                        continue
                    names.append(label)
                    device_prints.append(tensor_print(value))
                elif isinstance(value, (int, float)):
                    numbers.append((label, number_print(value)))
    if state.scaler is not None and state.scaler.is_enabled():
        for key, value in sorted(state.scaler.state_dict().items()):
            if isinstance(value, (int, float)):
                numbers.append((f"GradScaler {key}", number_print(value)))
    for key in ("epoch", "step", "step_in_epoch", "samples_in_epoch"):
        numbers.append((f"position {key}", int(getattr(state.position, key))))
    # One transfer from the device for all tensors (a single synchronization on a GPU).
    prints = torch.stack(device_prints).cpu() if device_prints else torch.zeros(0, dtype=torch.int64)
    names += [label for label, _ in numbers]
    values = torch.cat([prints, torch.tensor([value for _, value in numbers], dtype=torch.int64)])
    return names, values


def compare(names: list[str], gathered: list[torch.Tensor]) -> tuple[str, list[int], int] | None:
    """The first entry in which some rank's fingerprint differs from rank 0's, the ranks that differ
    there, and how many entries differ in all; None when every rank agrees."""
    reference = gathered[0]
    differing = torch.zeros(len(reference), dtype=torch.bool)
    for values in gathered[1:]:
        differing |= values != reference
    if not differing.any():
        return None
    first = int(differing.nonzero()[0])
    ranks = [rank for rank, values in enumerate(gathered) if rank and values[first] != reference[first]]
    return names[first], ranks, int(differing.sum())


def audit(state: AuditedState, where: str, floating_buffers: bool, optimizer_state: bool = True) -> str | None:
    """Compare every rank's state with rank 0's (a collective: every rank calls it at the same point).

    Returns None when the ranks agree, else the one line that names the first difference (the same
    line on every rank)."""
    if dist.size() == 1:
        return None
    names, values = fingerprint(state, floating_buffers, optimizer_state)
    # One collective: each rank's count, then its values (Horovod's allgather takes tensors of
    # different lengths along dimension 0).
    flat = dist.allgather(torch.cat([torch.tensor([len(values)], dtype=torch.int64), values]),
                          name="hvdtrain.fault.audit")
    gathered, counts, offset = [], [], 0
    while offset < len(flat):
        count = int(flat[offset])
        counts.append(count)
        gathered.append(flat[offset + 1:offset + 1 + count])
        offset += 1 + count
    if len(set(counts)) > 1:  # a tensor exists on some ranks only (e.g. optimizer state)
        all_names = dist.allgather_object(names, name="hvdtrain.fault.audit.names")
        ranks = [rank for rank, listed in enumerate(all_names) if listed != all_names[0]]
        missing = sorted(set(all_names[0]) ^ set(all_names[ranks[0]])) if ranks else []
        return (f"ranks hold different states at {where}: rank(s) {', '.join(map(str, ranks))} hold "
                f"{', '.join(str(counts[r]) for r in ranks)} values where rank 0 holds {counts[0]}"
                + (f" ({missing[0]} is on some ranks only)" if missing else ""))
    found = compare(names, gathered)
    if found is None:
        return None
    name, ranks, count = found
    return (f"ranks hold different states at {where}: {name} differs on rank(s) {', '.join(map(str, ranks))} "
            f"from rank 0 ({count} of {len(names)} values differ; the first is named). Look for a "
            f"non-deterministic op, a rank that skipped an optimizer or GradScaler step, or state that "
            f"the broadcast missed (docs/fault-tolerance.md, \"Cross-rank audit\")")
