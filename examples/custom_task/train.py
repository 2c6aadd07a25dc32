"""The tabular example through the Python API (no YAML needed, though one is used here):

    horovodrun -np 2 python train.py [key=value ...]
    mpirun -np 2 -bind-to none -map-by slot python train.py [key=value ...]
    srun --mpi=pmix -n 2 python train.py [key=value ...]

Trains, then evaluates the last checkpoint on the same ranks, and prints one JSON line per rank
with the final validation metrics of both and a digest of the rank's parameters (every rank must
hold the same model).
"""

import hashlib
import json
import sys
from pathlib import Path

from tabular_task import TabularTask

import hvdtrain

HERE = Path(__file__).resolve().parent


def digest(model) -> str:
    sha = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        sha.update(name.encode() + tensor.detach().cpu().numpy().tobytes())
    return sha.hexdigest()[:16]


def main() -> None:
    # The class; config.yaml (with the task's own section, tabular:); command-line overrides last.
    result = hvdtrain.fit(TabularTask, HERE / "config.yaml", overrides=sys.argv[1:])
    evaluated = hvdtrain.evaluate(result.run_dir / "checkpoints" / "last.pt")
    line = json.dumps({"rank": result.rank, "size": result.size, "params": digest(result.model),
                       "fit_val": result.metrics["val"], "evaluate": evaluated})
    # One write per line: print() writes the text and the newline apart when stdout is unbuffered, and
    # mpirun, forwarding every rank's pipe, can then put another rank's line in between.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


if __name__ == "__main__":  # loader workers (forkserver, spawn) import this file: train only when run
    main()
