"""Model EMA: an exponential moving average of the weights, a state component like any other.

After every ``ema.every_steps``-th optimizer step the averaged parameters move towards the
model's: ``ema = d * ema + (1 - d) * w`` with the decay ``d`` warmed up as timm's ``ModelEmaV3``
does (``min(decay, 1 - (1 + t / gamma) ^ -power)``, t counting from the first update), so that the
average does not drag the random initialization along for thousands of steps.

Identical on every rank, by construction:

* the parameters: every rank applies the same averaged gradients, so the weights the EMA follows
  are the same on every rank, and the update is the same arithmetic;
* the buffers (BatchNorm statistics): during an epoch each rank's are its own (without SyncBN), so
  the EMA does not follow them step by step; it copies the model's buffers at the end of each epoch,
  after ``dist.average_buffers`` has made them equal on every rank, before validating (and these
  copies are the EMA's BatchNorm statistics). They are running averages already.

Registered as ``ema`` with ``RunState.register``: checkpoints, the resume broadcast and elastic
commits carry it (``state_dict`` / ``load_state_dict``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..config import EmaConfig
from ..model.build import unwrap_state_dict


def ema_decay(updates: int, cfg: EmaConfig) -> float:
    """The decay of update number ``updates`` (1-based): timm ModelEmaV3's warm-up, or the constant."""
    if not cfg.warmup:
        return cfg.decay
    t = max(0, updates - 1)
    if t == 0:
        return 0.0  # the first update copies the weights
    return min(cfg.decay, 1.0 - (1.0 + t / cfg.warmup_gamma) ** -cfg.warmup_power)


class ModelEma:
    """The averaged copy of a model (a module of the same architecture, never trained)."""

    def __init__(self, model: torch.nn.Module, cfg: EmaConfig):
        self.cfg = cfg
        self.module = copy.deepcopy(unwrap(model)).eval()
        if getattr(self.module, "_compiled_call_impl", None) is not None:
            self.module._compiled_call_impl = None  # validated a few times per run: not worth compiling
        for param in self.module.parameters():
            param.requires_grad_(False)
        self.updates = 0
        self.params: list[torch.Tensor] = [p for p in self.module.parameters()]

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        """One EMA step towards ``model``'s parameters (after the optimizer step)."""
        self.updates += 1
        weight = 1.0 - ema_decay(self.updates, self.cfg)
        current = [p.detach() for p in unwrap(model).parameters()]
        torch._foreach_lerp_(self.params, current, weight)

    def after_optimizer_step(self, state: Any) -> None:
        """The engine's hook: update every ``ema.every_steps`` global steps."""
        if state.position.step % self.cfg.every_steps == 0:
            self.update(state.model)

    @torch.no_grad()
    def copy_buffers(self, model: torch.nn.Module) -> None:
        """Take the model's (rank-averaged) buffers: call after ``dist.average_buffers``."""
        for mine, theirs in zip(self.module.buffers(), unwrap(model).buffers()):
            mine.copy_(theirs)

    def state_dict(self) -> dict[str, Any]:
        return {"module": unwrap_state_dict(self.module), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.updates = int(state["updates"])


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under ``torch.compile``'s wrapper (``Module.compile()`` keeps it in place)."""
    return getattr(model, "_orig_mod", model)
