"""A rank that looks for a secret in every process's arguments while the job runs.

    horovodrun --gloo -np 2 -H localhost:2 python secrets_probe.py DIR

``DIR/marker`` holds the secret (the test puts the same value in WANDB_API_KEY and other
variables of the launch): the rank reads it from there, not from its arguments or environment.
Each rank first waits until every rank of the job has started (a file per rank in DIR), so that
every launcher process (``sh -c``, ``ssh``) of the job is alive while it scans ``/proc/*/cmdline``.
It prints one JSON line: its rank, which of the watched variables it sees with the secret value,
and the processes whose arguments hold the secret (their PIDs and first argument only).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

WATCHED = ("WANDB_API_KEY", "MLFLOW_TRACKING_PASSWORD", "AWS_SECRET_ACCESS_KEY", "HVDTRAIN_TEST_MULTILINE")


def processes_showing(secret: bytes) -> list[dict]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if secret in argv:
            found.append({"pid": int(entry.name), "argv0": argv.split(b"\0")[0].decode(errors="replace")})
    return found


def main() -> None:
    folder = Path(sys.argv[1])
    secret = (folder / "marker").read_text().strip()
    rank, size = int(os.environ["HOROVOD_RANK"]), int(os.environ["HOROVOD_SIZE"])
    (folder / f"started-{rank}").touch()
    deadline = time.monotonic() + 60
    while sum(1 for r in range(size) if (folder / f"started-{r}").exists()) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = sorted(name for name in WATCHED if secret in os.environ.get(name, ""))
    line = {"rank": rank, "seen": seen, "multiline_intact": os.environ.get("HVDTRAIN_TEST_MULTILINE") ==
            f"first line\n{secret} 'quoted' $HOME"}
    line["showing"] = processes_showing(secret.encode())
    # Stay until every rank has scanned: a rank that left early would end its launcher processes.
    (folder / f"scanned-{rank}").touch()
    while sum(1 for r in range(size) if (folder / f"scanned-{r}").exists()) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.write("SECRETS " + json.dumps(line) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
