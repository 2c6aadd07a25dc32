"""One optimizer step of hvdtrain's engine under ``dist.op=adasum``, on a two-element weight whose
gradient is each rank's own: rank 0's (1, 0), rank 1's (1, 1); SGD at rate 0.1, weight (1, 2) to
start. Prints one JSON line per rank: the weight after the step, and again after a second step of
two backward passes (``backward_passes_per_step=2``, each pass's loss halved, as the engine does)."""
# tests/shared_ranks: this script may run on the shared ranks

import json
import sys

import torch

from hvdtrain.comm import dist
from hvdtrain.train.engine import StepSettings, optimizer_step
from hvdtrain.train.state import RunState


def weight_after(passes: int) -> list[float]:
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = dist.distributed_optimizer(sgd, model.named_parameters(), compression="none",
                                           backward_passes_per_step=passes, op="adasum")
    state = RunState(model, optimizer)
    settings = StepSettings(task=None, device=torch.device("cpu"), lr_schedule=None,
                            backward_passes_per_step=passes, steps_in_backward=True)
    gradient = torch.tensor([1.0, float(dist.rank())])
    for _ in range(passes):
        ((model.weight * gradient).sum() / passes).backward()
    optimizer_step(state, settings)
    return model.weight.detach().tolist()


if __name__ == "__main__":
    dist.init(gpu=False)
    one, two = weight_after(1), weight_after(2)
    sys.stdout.write(json.dumps({"rank": dist.rank(), "size": dist.size(), "one_pass": one, "two_passes": two}) + "\n")
    sys.stdout.flush()
