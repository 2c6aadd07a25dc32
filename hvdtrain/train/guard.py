"""How a run's training goes wrong in a way no step can repair, and how the job then stops: JobStopped
(one line from one rank, an exit code), and FiniteGuard, which notices a run gone non-finite
before anything of it is saved.
"""

from __future__ import annotations

import torch

from .. import outcome
from ..comm import dist


class JobStopped(Exception):
    """The run cannot go on (it diverged, a rank was lost, the ranks disagree): one line, printed by
    the rank whose ``speak`` is set; the job exits with ``exit_code`` (outcome.stop_code)."""

    exit_code = outcome.EXIT_CRASH

    def __init__(self, line: str, speak: bool):
        super().__init__(line)
        self.speak = speak


class FiniteGuard:
    """Stops a run whose training has become non-finite (a loss or gradients of inf/NaN: a learning
    rate too high, an overflow) before anything of it is saved.

    It looks at the *averaged* gradients, which are the same on every rank, so every rank reaches
    the same verdict at the same step without a collective of its own: one small gradient (the last
    trainable parameter's, which every loss reaches) is checked after the allreduce. With a
    GradScaler (fp16 AMP) a non-finite step is skipped rather than applied, as AMP intends; only
    ``amp.max_skipped_steps`` skips in a row mean divergence. The verdict stays on the device and
    is read (a host sync) every ``check_every`` steps, at the epoch end and before every checkpoint;
    the line names the first bad step."""

    def __init__(self, device: torch.device, check_every: int, max_skipped: int):
        self.check_every, self.max_skipped = check_every, max_skipped
        self.first_bad = torch.full((), -1, dtype=torch.int64, device=device)   # step that went non-finite
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)        # GradScaler skips in a row
        self.probe: torch.Tensor | None = None

    def probe_grad(self, model: torch.nn.Module) -> torch.Tensor | None:
        if self.probe is None or self.probe.grad is None:
            self.probe = next((p for p in reversed(list(model.parameters())) if p.grad is not None), None)
        if self.probe is None:
            return None
        grad = self.probe.grad
        return grad._values() if grad.is_sparse else grad

    def after_allreduce(self, model: torch.nn.Module, step: int, weights: bool = False) -> None:
        """Without a GradScaler: note the step if its averaged gradients are not finite; with
        ``weights``, if the weights they reach are not (Adasum's combined step: each rank's own
        gradients differ, the combined weights do not)."""
        grad = self.probe_grad(model)
        if grad is not None and weights:
            grad = self.probe.detach()
        if grad is not None:
            bad = ~torch.isfinite(grad).all()
            self.first_bad = torch.where(bad & (self.first_bad < 0), step, self.first_bad)

    def after_scaler_update(self, old_scale: torch.Tensor, new_scale: torch.Tensor, step: int) -> None:
        """With a GradScaler: a lowered scale is a skipped step; too many in a row is divergence."""
        skipped = new_scale < old_scale
        self.skipped = torch.where(skipped, self.skipped + 1, torch.zeros_like(self.skipped))
        if self.max_skipped:
            over = self.skipped >= self.max_skipped
            self.first_bad = torch.where(over & (self.first_bad < 0), step - self.max_skipped + 1, self.first_bad)

    def check(self, step: int | None = None) -> None:
        """Raise ``JobStopped`` on every rank if training has gone non-finite (a host sync); with
        ``step``, only every ``check_every`` steps."""
        if step is not None and step % self.check_every:
            return
        first = int(self.first_bad)
        if first < 0:
            return
        cause = (f"the GradScaler skipped {self.max_skipped} steps in a row from global step {first + 1} on "
                 f"(inf/NaN gradients at every scale; amp.max_skipped_steps)" if int(self.skipped) >= self.max_skipped
                 and self.max_skipped else f"the averaged gradients became inf/NaN at global step {first + 1}")
        raise JobStopped(f"hvdtrain: training diverged: {cause}. Nothing of it was saved: the last checkpoint "
                         f"is the last finite state. Lower optim.base_lr, lengthen optim.warmup_epochs or set "
                         f"optim.clip_grad_norm, then resume or start again", speak=dist.is_primary())
