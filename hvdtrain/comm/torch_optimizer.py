"""The torch engine's distributed optimizer: Horovod's ``DistributedOptimizer`` protocol on
torch.distributed, for the user's own optimizer object (its class, its ``state_dict``: a checkpoint
is the same under either engine).

A hook on each parameter counts the backward passes that reached it; on the last of
``backward_passes_per_step`` its gradient is ready. Gradients go in buckets (comm/buckets.py, one
per parameter without ``bucket_mb``), each sent as one asynchronous averaging allreduce once all of
its gradients are ready, and in bucket order only: torch.distributed matches collectives by the
order ranks start them (DDP's reducer launches its buckets in order for the same reason).
``synchronize()`` sends what is left (zeros for a parameter that got no gradient, since another rank
may have one: Horovod does the same) and waits; ``step()`` synchronizes first unless inside
``skip_synchronize()``, the protocol the loop follows for AMP: synchronize, unscale, clip, step.
With fp16 compression a float32 gradient travels as float16 (summed and averaged in float16, as
Horovod's Compression.fp16 does) and is cast back.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator

import torch

from .buckets import gradient_buckets

TOO_MANY_PASSES = ("Gradients were computed more than backward_passes_per_step times before call to step(). "
                   "Increase backward_passes_per_step to accumulate gradients locally.")  # Horovod's words


class GradientAverager:
    """Averages the gradients of ``optimizer``'s parameters over the ranks (see the module's text).
    ``start(tensor, "average", name)`` starts an in-place averaging allreduce and ``wait(handle)``
    ends it (the torch engine's)."""

    _of: "weakref.WeakKeyDictionary[torch.optim.Optimizer, GradientAverager]" = weakref.WeakKeyDictionary()

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: list[tuple[str, torch.nn.Parameter]],
                 fp16: bool, passes: int, bucket_mb: float, sparse_as_dense: bool,
                 start: Callable[..., Any], wait: Callable[[Any], torch.Tensor]):
        wanted = {p for group in optimizer.param_groups for p in group["params"] if p.requires_grad}
        ordered = list(dict.fromkeys([p for _, p in named_parameters if p in wanted]))
        named = set(ordered)
        ordered += [p for group in optimizer.param_groups for p in group["params"] if p in wanted and p not in named]
        self.buckets = gradient_buckets(ordered, bucket_mb) if bucket_mb > 0 else [[p] for p in reversed(ordered)]
        self.bucket_of = {p: index for index, bucket in enumerate(self.buckets) for p in bucket}
        self.fp16, self.passes, self.sparse_as_dense = fp16, passes, sparse_as_dense
        self.start, self.wait = start, wait
        self.delay = {p: passes for p in ordered}
        self.ready = [0] * len(self.buckets)
        self.launched = 0  # buckets sent so far in this step, in bucket order
        self.in_flight: list[tuple[Any, torch.Tensor, list[torch.nn.Parameter], bool]] = []
        self.should_synchronize = True
        for p in ordered:
            p.register_post_accumulate_grad_hook(self._hook)
        optimizer.register_step_pre_hook(self._before_step)
        GradientAverager._of[optimizer] = self

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> GradientAverager:
        return cls._of[optimizer]

    def _hook(self, param: torch.Tensor) -> None:
        if self.delay[param] <= 0:
            raise AssertionError(TOO_MANY_PASSES)
        self.delay[param] -= 1
        if self.delay[param] == 0:
            self.ready[self.bucket_of[param]] += 1
            while self.launched < len(self.buckets) and self.ready[self.launched] == len(self.buckets[self.launched]):
                self._send(self.launched)
                self.launched += 1

    def _send(self, index: int) -> None:
        """Start averaging bucket ``index``'s gradients: one allreduce per dtype in it."""
        by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
        for p in self.buckets[index]:
            if p.grad is None:  # no gradient on this rank; another rank may have one
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p)
        for params in by_dtype.values():
            sparse = any(p.grad.is_sparse for p in params)
            if sparse and not self.sparse_as_dense:
                raise ValueError("dist.engine=torch averages sparse gradients as dense ones: set "
                                 "dist.sparse_as_dense=true")
            grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in params]
            if len(grads) == 1 and grads[0].is_contiguous() and not sparse:
                flat = grads[0].view(-1)  # averaged in place: nothing to copy back
            else:
                flat = torch.cat([g.reshape(-1) for g in grads])
            if self.fp16 and flat.dtype == torch.float32:
                flat = flat.to(torch.float16)
            self.in_flight.append((self.start(flat, "average", f"hvdtrain.grad.{index}"), flat, params, sparse))

    def synchronize(self) -> None:
        """Send what backward left (in bucket order), wait for every average, and put it in ``.grad``."""
        for index in range(self.launched, len(self.buckets)):
            self._send(index)
        in_flight, self.in_flight = self.in_flight, []
        for handle, flat, params, sparse in in_flight:
            self.wait(handle)
            if len(params) == 1 and flat.data_ptr() == params[0].grad.data_ptr():
                continue
            offset = 0
            for p in params:
                part = flat[offset:offset + p.numel()].view(p.shape).to(p.dtype)
                offset += p.numel()
                if sparse and p.grad.is_sparse:
                    p.grad = part.to_sparse()
                else:
                    p.grad.copy_(part)
        self.delay = dict.fromkeys(self.delay, self.passes)
        self.ready = [0] * len(self.buckets)
        self.launched = 0

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not synchronize (the caller just did)."""
        self.should_synchronize = False
        try:
            yield
        finally:
            self.should_synchronize = True

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.should_synchronize:
            self.synchronize()
