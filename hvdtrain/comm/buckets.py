"""Gradient buckets: the trainable parameters in groups that Horovod allreduces as one fused
allreduce each (the buckets of DistributedDataParallel). Pure torch; dist.distributed_optimizer
hands them to Horovod as ``groups``.
"""

from __future__ import annotations

import torch


def gradient_buckets(parameters: list[torch.nn.Parameter], bucket_mb: float) -> list[list[torch.nn.Parameter]]:
    """The trainable parameters in groups of at least ``bucket_mb`` MB (the last may be smaller),
    in reverse registration order, which is about the order backward produces their gradients.

    Horovod allreduces a group once all of its gradients are ready, as one fused allreduce: the
    buckets of DistributedDataParallel. Without groups, every cycle (HOROVOD_CYCLE_TIME) fuses
    whatever gradients happen to be ready, so one backward pass becomes many smaller allreduces,
    each with its own negotiation; under Gloo on CPU that cost is measurable
    (benchmarks/results/gloo-gap_amd-epyc-2core_2026-11-24.md).
    A parameter that gets no gradient in a step leaves its group incomplete; Horovod then reduces
    that group's gradients one by one in ``step()``, on every rank alike."""
    limit = bucket_mb * 1e6
    buckets: list[list[torch.nn.Parameter]] = [[]]
    filled = 0
    for parameter in reversed(parameters):
        if not parameter.requires_grad:
            continue
        if filled >= limit:
            buckets.append([])
            filled = 0
        buckets[-1].append(parameter)
        filled += parameter.numel() * parameter.element_size()
    return [bucket for bucket in buckets if bucket]
