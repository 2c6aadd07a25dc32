"""Layer-wise adaptive optimizers for large global batches: LARS and LAMB.

Both are plain ``torch.optim.Optimizer`` subclasses whose constructors accept the parameter groups
alone (every other argument has a default), which is what Horovod's ``DistributedOptimizer`` needs:
it re-creates the optimizer's class around ``optimizer.param_groups``. A group's ``adapt`` flag
says whether its rate is scaled by the layer's trust ratio; ``optim.build_optimizer`` clears it for
biases and normalization parameters.

* LARS (You, Gitman and Ginsburg 2017), as in MLPerf's ResNet-50 reference (TensorFlow
  ``LARSOptimizer``)::

      trust = eta * ||w|| / (||g|| + wd * ||w||)       (1 where ||w|| or ||g|| is 0)
      v     = momentum * v + lr * trust * (g + wd * w)
      w     = w - v                                    (Nesterov: w - (momentum * v + lr * trust * (g + wd * w)))

  Excluded parameters take ``v = momentum * v + lr * g`` (no trust ratio, no weight decay). The
  rate sits inside the momentum buffer, as in the reference (not torch's SGD form).
* LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), as in timm::

      m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2
      u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
      w = w - lr * (||w|| / ||u||) * u                 (trust 1 where a norm is 0, or the group is excluded)
"""

from __future__ import annotations

from typing import Callable

import torch


def trust_ratio(numerator: torch.Tensor, denominator: torch.Tensor, weight_norm: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where both the weight norm and the denominator are positive, else 1
    (a fresh zero layer or a zero gradient keeps the global rate). A tensor: no host sync."""
    one = torch.ones_like(weight_norm)
    return torch.where(weight_norm > 0, torch.where(denominator > 0, numerator / denominator, one), one)


class LARS(torch.optim.Optimizer):
    """Layer-wise Adaptive Rate Scaling, MLPerf ResNet-50's form (see the module docstring)."""

    def __init__(self, params, lr: float = 0.1, momentum: float = 0.9, weight_decay: float = 0.0,
                 eta: float = 0.001, nesterov: bool = False, adapt: bool = True):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      nesterov=nesterov, adapt=adapt))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                if group["adapt"]:
                    weight_norm, grad_norm = param.norm(), grad.norm()
                    trust = trust_ratio(group["eta"] * weight_norm, grad_norm + decay * weight_norm, weight_norm)
                    grad = grad.add(param, alpha=decay) if decay else grad
                    update = grad * (lr * trust)
                else:
                    update = grad * lr
                state = self.state[param]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(param)
                buffer = state["momentum_buffer"]
                buffer.mul_(momentum).add_(update)
                if group["nesterov"]:
                    param.sub_(buffer * momentum + update)
                else:
                    param.sub_(buffer)
        return loss


class LAMB(torch.optim.Optimizer):
    """Layer-wise Adaptive Moments for Batch training, timm's form (see the module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, adapt: bool = True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=adapt))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                state["step"] += 1
                step = float(state["step"])
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(grad, alpha=1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denominator = (exp_avg_sq / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                update = (exp_avg / (1 - beta1 ** step)).div_(denominator)
                if group["weight_decay"]:
                    update.add_(param, alpha=group["weight_decay"])
                if group["adapt"]:
                    weight_norm = param.norm()
                    update.mul_(trust_ratio(weight_norm, update.norm(), weight_norm))
                param.sub_(update, alpha=group["lr"])
        return loss
