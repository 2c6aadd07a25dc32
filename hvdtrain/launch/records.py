"""A rank's exit record for ``hvdtrain launch`` (launch/horovodrun.py): the line a rank leaving with
a non-zero code writes, and the file it leaves in the launcher's private folder.

Standard library only: a rank writes its record also when hvdtrain's own imports failed (a module of
the user's that shadows PyYAML, say: environment.report_import_failure), so nothing here may import
the config or anything that reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

TOKEN_VARIABLE = "HVDTRAIN_LAUNCH_TOKEN"
RECORDS_VARIABLE = "HVDTRAIN_LAUNCH_RECORDS"
RECORD = "hvdtrain-exit"


def exit_record(rank: int, code: int, cause: str) -> str | None:
    """The line a rank writes as it leaves with ``code`` under ``hvdtrain launch`` (None otherwise)."""
    token = os.environ.get(TOKEN_VARIABLE)
    if not token or code == 0:
        return None
    return f"{RECORD} {token} " + json.dumps({"rank": rank, "code": code, "cause": cause.strip()[:2000]})


def record_exit(rank: int, code: int, cause: str) -> None:
    """A rank's exit record, both ways: the line in its output (which horovodrun brings back from
    every host), and, on the launcher's own host, a file in the launcher's private folder
    (``$HVDTRAIN_LAUNCH_RECORDS``). mpirun told to end (a scheduler's SIGTERM to every process of
    the job) sleeps before it ends its ranks and drops what they print meanwhile: the file is how the
    stop they made then still reaches the launcher."""
    line = exit_record(rank, code, cause)
    if line is None:
        return
    sys.stderr.write(line + "\n")  # one write: a launcher that tags output per write keeps it on one line
    sys.stderr.flush()
    folder = os.environ.get(RECORDS_VARIABLE, "")
    if folder and os.path.isdir(folder):
        record = line.split(" ", 2)[2]
        with contextlib.suppress(OSError):
            scratch = os.path.join(folder, f".rank-{rank}.{os.getpid()}")
            with open(scratch, "x", encoding="utf-8") as handle:
                handle.write(record)
            os.replace(scratch, os.path.join(folder, f"rank-{rank}.json"))


def read_record_files(folder: Path) -> list[dict]:
    """The records ranks on this host left in ``folder``, oldest first."""
    found = []
    for path in sorted(folder.glob("rank-*.json"), key=lambda p: p.stat().st_mtime_ns):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            found.append({"rank": int(record["rank"]), "code": int(record["code"]), "cause": str(record["cause"])})
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found
