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

  Excluded parameters take ``v = momentum * v + lr * (g + wd * w)`` (no trust ratio; their group's
  weight decay, 0 unless ``optim.no_decay`` decays them, as NVIDIA's MLPerf LARS decays the fc
  bias). The rate sits inside the momentum buffer, as in the reference (not torch's SGD form), so
  a changing rate changes the effective momentum: ``momentum_correction`` multiplies the momentum
  by ``lr_t / lr_(t-1)`` (Goyal et al. 2017, section 3; NVIDIA's MLPerf ``SGDwFASTLARS``).
* LAMB (You et al. 2019, "Large Batch Optimization for Deep Learning"), as in timm::

      m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2
      u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
      w = w - lr * (||w|| / ||u||) * u                 (trust 1 where a norm is 0, or the group is excluded)

  With ``max_grad_norm`` > 0 every gradient is first divided by ``max(1, ||g_all|| / max_grad_norm)``,
  the global norm over all parameters (timm's ``Lamb``, NVIDIA's FusedLAMB: default 1.0).
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
                 eta: float = 0.001, nesterov: bool = False, adapt: bool = True, momentum_correction: bool = False):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"LARS momentum must be in [0, 1), got {momentum}")
        # last_lr: the rate of the group's previous step (0 before the first), for the correction;
        # a group option, so it travels in the optimizer's state dict (checkpoints, resume).
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay, eta=eta,
                                      nesterov=nesterov, adapt=adapt, momentum_correction=momentum_correction,
                                      last_lr=0.0))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            if group.get("momentum_correction") and group.get("last_lr", 0.0) > 0:
                momentum = momentum * lr / group["last_lr"]
            group["last_lr"] = lr
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad
                grad_with_decay = grad.add(param, alpha=decay) if decay else grad
                if group["adapt"]:
                    weight_norm, grad_norm = param.norm(), grad.norm()
                    trust = trust_ratio(group["eta"] * weight_norm, grad_norm + decay * weight_norm, weight_norm)
                    update = grad_with_decay * (lr * trust)
                else:
                    update = grad_with_decay * lr
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
                 weight_decay: float = 0.0, adapt: bool = True, max_grad_norm: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, adapt=adapt,
                                      max_grad_norm=max_grad_norm))

    def global_clip(self) -> torch.Tensor | None:
        """timm's global gradient clipping: the divisor max(1, ||g|| / max_grad_norm), as a tensor (no
        host sync), or None when off. Read from the groups: Horovod re-creates the optimizer from them."""
        max_norm = max((group.get("max_grad_norm", 0.0) for group in self.param_groups), default=0.0)
        grads = [param.grad for group in self.param_groups for param in group["params"] if param.grad is not None]
        if not max_norm or not grads:
            return None
        norm = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads]))
        return torch.clamp(norm / max_norm, min=1.0)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        clip = self.global_clip()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                grad = param.grad if clip is None else param.grad / clip.to(param.grad.dtype)
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
