"""Synchronized BatchNorm that also runs on the CPU.

Horovod's ``SyncBatchNorm`` uses CUDA-only kernels (``torch.batch_norm_stats`` and friends) and
refuses CPU tensors. On the GPU hvdtrain uses it; on the CPU this module computes the same thing
with plain tensor ops and Horovod collectives:

* forward: every rank computes its per-channel count, mean and biased variance; an allgather
  brings all of them to every rank, which combines them in rank order (Chan et al.'s parallel
  variance), so every rank normalizes with identical global statistics;
* backward: the per-channel sums of ``dy`` and ``dy * x_hat`` are allreduced, giving the exact
  gradient of the global batch; weight and bias gradients stay local, because the distributed
  optimizer averages them like any other parameter gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from ..comm import dist


def _channel_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


def _shape(x: torch.Tensor) -> list[int]:
    return [1, -1] + [1] * (x.dim() - 2)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum):
        dims = _channel_dims(x)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # half precision is computed in float32
        var, mean = torch.var_mean(xf, dim=dims, correction=0)
        count = torch.tensor([float(xf.numel() // xf.shape[1])], dtype=xf.dtype)
        gathered = dist.allgather(torch.cat([count, mean.cpu(), var.cpu()]).unsqueeze(0),
                                  name="hvdtrain.model.sync_bn.stats").to(x.device)
        channels = mean.numel()
        counts = gathered[:, :1]
        means = gathered[:, 1:1 + channels]
        variances = gathered[:, 1 + channels:]
        total = counts.sum()
        global_mean = (counts * means).sum(0) / total
        global_var = (counts * (variances + (means - global_mean) ** 2)).sum(0) / total
        if running_mean is not None:
            with torch.no_grad():
                unbiased = global_var * total / max(float(total) - 1.0, 1.0)
                running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        invstd = torch.rsqrt(global_var + eps)
        x_hat = (xf - global_mean.view(_shape(x))) * invstd.view(_shape(x))
        out = x_hat
        if weight is not None:
            out = out * weight.to(xf.dtype).view(_shape(x)) + bias.to(xf.dtype).view(_shape(x))
        ctx.save_for_backward(x_hat, invstd, weight, total)
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x_hat, invstd, weight, total = ctx.saved_tensors
        dims = _channel_dims(grad_out)
        dy = grad_out.to(x_hat.dtype)
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * x_hat).sum(dims)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None else None
        sums = dist.allreduce_sum(torch.cat([sum_dy, sum_dy_xhat]).cpu(), name="hvdtrain.model.sync_bn.grad")
        sums = sums.to(grad_out.device)
        channels = sum_dy.numel()
        mean_dy = (sums[:channels] / total).view(_shape(dy))
        mean_dy_xhat = (sums[channels:] / total).view(_shape(dy))
        scale = invstd if weight is None else invstd * weight.to(dy.dtype)
        grad_in = (dy - mean_dy - x_hat * mean_dy_xhat) * scale.view(_shape(dy))
        return grad_in.to(grad_out.dtype), grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm with statistics over the global batch of all ranks (CPU and GPU)."""

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {x.dim()}D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if not self.training or dist.size() == 1:
            use_batch_stats = self.training or not self.track_running_stats
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                use_batch_stats, self.momentum or 0.0, self.eps)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, self.running_mean, self.running_var,
                                            self.eps, self.momentum or 0.0)


def convert_sync_batchnorm(module: torch.nn.Module, cuda: bool) -> torch.nn.Module:
    """Replace every BatchNorm layer, keeping its parameters and running statistics.

    On CUDA the replacement is Horovod's own SyncBatchNorm (fused CUDA kernels); on the CPU it is
    ``SyncBatchNorm`` above.
    """
    cls = dist.CudaSyncBatchNorm if cuda else SyncBatchNorm
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, cls):
        converted = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        if module.affine:
            with torch.no_grad():
                converted.weight.copy_(module.weight)
                converted.bias.copy_(module.bias)
        if module.track_running_stats:
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, cuda))
    return converted
