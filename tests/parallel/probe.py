"""Train like ``python -m hvdtrain`` and then save what this rank ended with, for the tests.

Usage (under any launcher): probe.py OUT_DIR [--config FILE] [key=value ...]
Writes OUT_DIR/rank<r>.pt with the rank's final parameters, world layout and metrics.
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


def main() -> None:
    out = Path(sys.argv[1])
    args = train_parser().parse_args(sys.argv[2:])
    try:
        run, metrics = run_training(load_config(args.config, args.overrides))
    except Preempted as stop:  # as python -m hvdtrain does
        sys.exit(stop.exit_code)
    out.mkdir(parents=True, exist_ok=True)
    torch.save({
        "state": unwrap_state_dict(run.state.model),
        "rank": dist.rank(), "size": dist.size(), "local_rank": dist.local_rank(),
        "controller": dist.controller(), "metrics": metrics, "step": run.state.position.step,
        "launcher_env": launcher_env(),
        # Horovod's DistributedOptimizer: parameter -> the group its gradient is allreduced with.
        "gradient_groups": len(set(getattr(run.state.optimizer, "_p_to_group", {}).values())),
        "horovod_modules": sorted(name for name in sys.modules if name == "horovod" or name.startswith("horovod.")),
    }, out / f"rank{dist.rank()}.pt")


# tests/shared_ranks: this script may run on the shared ranks
if __name__ == "__main__":  # loader workers (forkserver) import this file: train only when run
    main()
