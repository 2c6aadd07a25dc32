"""Gradients averaged over the ranks during backward, as DDP does it, on Horovod: the model wrapper
behind ``hvdtrain.distributed.DistributedDataParallel`` (a DDP script's own loop; see
hvdtrain/distributed.py).

Rank 0's parameters and buffers go to every rank when the wrapper is made. Each gradient is sent
(Horovod's allreduce, averaged) as soon as backward has accumulated it, from a hook on its
parameter; Horovod's background thread fuses what is in flight. The first gradient of a backward
queues a callback that runs when backward ends: it sends zeros for the parameters that got no
gradient (every rank must send every name, or the others wait for it forever) and waits for all of
them, so the gradients are averaged when ``backward()`` returns and the optimizer is the user's own.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, Iterator

import torch

from . import dist

# Wrappers made in this process: each names its gradients apart (the same order on every rank).
_made = itertools.count(1)


class AveragingWrapper(torch.nn.Module):
    """``module`` with its gradients averaged over the ranks during backward. ``broadcast_buffers``:
    rank 0's buffers before every training forward (one broadcast per dtype and device); ``fp16``:
    float32 gradients sent as float16. ``no_sync()``, ``.module`` and the ``module.`` prefix of
    ``state_dict()`` are DDP's."""

    def __init__(self, module: torch.nn.Module, broadcast_buffers: bool = True, fp16: bool = False):
        super().__init__()
        self.module = module
        self.broadcast_buffers = broadcast_buffers
        self.fp16 = fp16
        self.require_backward_grad_sync = True
        self._prefix = f"hvdtrain.ddp{next(_made)}"
        self._params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self._sent: dict[str, tuple[int, torch.Tensor, torch.Tensor]] = {}  # name -> (handle, sent, grad)
        self._queued = False
        self._sync_tensors(list(module.parameters()) + list(module.buffers()), "init")
        for name, param in self._params:
            param.register_post_accumulate_grad_hook(self._ready_hook(name))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.broadcast_buffers and self.module.training and dist.size() > 1:
            self._sync_tensors(list(self.module.buffers()), "buffers")
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside keep their gradients to this rank (accumulating); the first one
        outside averages the sum."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def _sync_tensors(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's ``tensors`` on every rank, in place: one broadcast per dtype and device."""
        if dist.size() == 1 or not tensors:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for tensor in tensors:
            groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for index, group in enumerate(groups.values()):
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            dist.wait(dist.broadcast_async_(flat, 0, f"{self._prefix}.{what}.{index}"))
            offset = 0
            with torch.no_grad():
                for t in group:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _ready_hook(self, name: str):
        def hook(param: torch.Tensor) -> None:
            if not self.require_backward_grad_sync or dist.size() == 1:
                return
            if not self._queued:  # the first gradient of this backward: finish when backward does
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self._send(name, param)
        return hook

    def _send(self, name: str, param: torch.Tensor) -> None:
        grad = param.grad
        sent = grad.to(torch.float16) if self.fp16 and grad.dtype == torch.float32 else grad
        self._sent[name] = (dist.allreduce_async_(sent, "average", f"{self._prefix}.grad.{name}"), sent, grad)

    def _finish(self) -> None:
        """After backward: a zero gradient sent for each parameter that got none (every rank must send
        every name), then the averages waited for."""
        for name, param in self._params:
            if name not in self._sent:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                self._send(name, param)
        sent, self._sent, self._queued = self._sent, {}, False
        for handle, tensor, grad in sent.values():
            dist.wait(handle)  # quietly (comm.dist.wait_quietly)
            if tensor is not grad:
                grad.copy_(tensor)
