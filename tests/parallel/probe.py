"""Train like ``python -m hvdtrain`` and then save what this rank ended with, for the tests.

Usage (under any launcher): probe.py OUT_DIR [--wire] [--config FILE] [key=value ...]
Writes OUT_DIR/rank<r>.pt with the rank's final parameters, world layout and metrics. ``--wire``
(Horovod engine) also records what Horovod's DistributedOptimizer sent: how many allreduce calls
and the dtypes of the gradients they carried.
"""

import os
import sys
from pathlib import Path

import torch

from hvdtrain.api import run_training
from hvdtrain.cli import train_parser
from hvdtrain.comm import dist
from hvdtrain.comm import launcher_env as launcher
from hvdtrain.job_config import load_config
from hvdtrain.model.build import unwrap_state_dict
from hvdtrain.train.stops import Preempted


def launcher_env() -> dict[str, str]:
    """The rank variables the launcher set (horovodrun, mpirun or srun)."""
    keys = launcher.RANK_VARIABLES + launcher.SIZE_VARIABLES + launcher.LOCAL_RANK_VARIABLES
    return {key: os.environ[key] for key in keys if key in os.environ}


class Wire:
    """Counts the allreduce calls of Horovod's DistributedOptimizer and the dtypes they carry, by
    wrapping the two functions its module calls; ``close()`` puts them back (the shared ranks run
    later jobs in this process)."""

    NAMES = ("allreduce_async_", "grouped_allreduce_async_")

    def __init__(self) -> None:
        import horovod.torch.optimizer as module

        self.module, self.calls, self.dtypes = module, 0, set()
        self.originals = {name: getattr(module, name) for name in self.NAMES}
        for name, original in self.originals.items():
            setattr(module, name, self.wrap(original))

    def wrap(self, original):
        def recorded(tensors, *args, **kwargs):
            self.calls += 1
            self.dtypes.update(str(t.dtype) for t in (tensors if isinstance(tensors, (list, tuple)) else [tensors]))
            return original(tensors, *args, **kwargs)
        return recorded

    def close(self) -> dict:
        for name, original in self.originals.items():
            setattr(self.module, name, original)
        return {"allreduce_calls": self.calls, "dtypes": sorted(self.dtypes)}


def main() -> None:
    out = Path(sys.argv[1])
    argv = sys.argv[2:]
    wire = Wire() if "--wire" in argv else None
    args = train_parser().parse_args([a for a in argv if a != "--wire"])
    try:
        run, metrics = run_training(load_config(args.config, args.overrides))
    except Preempted as stop:  # as python -m hvdtrain does
        sys.exit(stop.exit_code)
    finally:
        sent = wire.close() if wire is not None else None
    scaler = run.state.scaler
    out.mkdir(parents=True, exist_ok=True)
    torch.save({
        "state": unwrap_state_dict(run.state.model),
        "rank": dist.rank(), "size": dist.size(), "local_rank": dist.local_rank(),
        "controller": dist.controller(), "metrics": metrics, "step": run.state.position.step,
        "launcher_env": launcher_env(),
        # Horovod's DistributedOptimizer: parameter -> the group its gradient is allreduced with.
        "gradient_groups": len(set(getattr(run.state.optimizer, "_p_to_group", {}).values())),
        "wire": sent,
        "scale": scaler.get_scale() if scaler is not None and scaler.is_enabled() else None,
        "parameters": sum(1 for p in run.state.model.parameters() if p.requires_grad),
        "backward_passes": getattr(run.state.optimizer, "backward_passes_per_step", None),
        "horovod_modules": sorted(name for name in sys.modules if name == "horovod" or name.startswith("horovod.")),
    }, out / f"rank{dist.rank()}.pt")


# tests/shared_ranks: this script may run on the shared ranks
if __name__ == "__main__":  # loader workers (forkserver) import this file: train only when run
    main()
