"""Write what this process holds of the state the shared ranks restore (tests/shared_ranks/
process_state.py), after changing every piece of it with --dirty.

Usage (under any launcher): process_state_probe.py OUT_DIR [--dirty]
Writes OUT_DIR/rank<r>.json.
"""

import faulthandler
import gc
import json
import logging
import multiprocessing
import os
import random
import socket
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing

from tests.shared_ranks import process_state


def dirty() -> None:
    """Change every entry of process_state.STATE, as a careless job might."""
    torch.set_num_threads(2 if torch.get_num_threads() != 2 else 1)
    torch.set_default_dtype(torch.float64)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("medium")
    torch.set_grad_enabled(False)
    torch.set_anomaly_enabled(True)
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    os.umask(0o002)
    sys.setrecursionlimit(sys.getrecursionlimit() + 500)
    socket.setdefaulttimeout(7.0)
    multiprocessing.set_start_method("spawn", force=True)
    torch.multiprocessing.set_sharing_strategy("file_system")
    logging.basicConfig(level=logging.DEBUG, force=True)
    sys.excepthook = threading.excepthook = sys.unraisablehook = lambda *args: None
    gc.disable()
    gc.set_threshold(100, 5, 5)
    faulthandler.enable() if not faulthandler.is_enabled() else faulthandler.disable()


def main() -> None:
    out = Path(sys.argv[1])
    before = process_state.describe()
    if "--dirty" in sys.argv[2:]:
        dirty()
        changed = {name for name, value in process_state.describe().items() if value != before[name]}
        untouched = set(before) - changed
        assert not untouched, f"the probe changed nothing of {sorted(untouched)}"
    out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    (out / f"rank{rank}.json").write_text(json.dumps(process_state.describe(), indent=1))


# tests/shared_ranks: this script may run on the shared ranks
if __name__ == "__main__":
    main()
