"""Gradients of 60000 on each of two ranks, sent as float16 (dist.compression=fp16), averaged with
and without ``gradient_predivide_factor=2``: the float16 sum of 120000 is past float16's largest
value (65504), the sum of the halves is not. Prints one JSON line per rank: the averaged gradient
for each factor."""
# tests/shared_ranks: this script may run on the shared ranks

import json
import sys

import torch

from hvdtrain.comm import dist


def averaged(factor: float) -> list[float]:
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = dist.distributed_optimizer(torch.optim.SGD(model.parameters(), lr=0.0), model.named_parameters(),
                                           compression="fp16", backward_passes_per_step=1, op="average",
                                           gradient_predivide_factor=factor)
    (model.weight * torch.tensor([60000.0, 2.0])).sum().backward()
    dist.synchronize(optimizer)
    gradient = model.weight.grad.tolist()
    with dist.skip_synchronize(optimizer):
        optimizer.step()
    optimizer.zero_grad()
    return gradient


if __name__ == "__main__":
    dist.init(gpu=False)
    result = {"rank": dist.rank(), "factor_1": averaged(1.0), "factor_2": averaged(2.0)}
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
