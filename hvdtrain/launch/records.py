"""A rank's exit record for ``hvdtrain launch`` (launch/horovodrun.py): the line a rank leaving with
a non-zero code writes, and the file it leaves in the launcher's private folder; and the launcher's
side: horovodrun's output copied without the records (``Output``: its closing traceback and mpirun's
abort block held back), and the job's code and last line (``outcome``).

Standard library only: a rank writes its record also when hvdtrain's own imports failed (a module of
the user's that shadows PyYAML, say: environment.report_import_failure), so nothing here may import
the config or anything that reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import IO

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


MEANINGS = {
    1: "a crash",
    2: "bad configuration or data",
    65: "data files vanished (see bad_files.jsonl in output.dir): restore them, then run the same command",
    74: "a checkpoint did not fit on its disk: free space, then run the same command",
    75: "stopped after a checkpoint: run the same command to resume",
    130: "interrupted",
}
def merged(records: list[dict], from_files: list[dict]) -> list[dict]:
    """The records of the output, then those only a file brought (one per rank)."""
    seen = {record["rank"] for record in records}
    return records + [record for record in from_files if record["rank"] not in seen]


# mpirun's closing block when a rank exits with a non-zero code ("... Per user-direction, the job has
# been aborted.", "mpirun detected that one or more processes exited with non-zero status ..."):
# where a rank recorded its cause, hvdtrain's own last line says it in one line instead.
MPIRUN_ABORT = ("Per user-direction, the job has been aborted",
                "detected that one or more processes exited with non-zero status")


def is_rule(line: str) -> bool:
    """mpirun frames its messages with a line of dashes."""
    return re.fullmatch(r"-{20,}", line.strip()) is not None


class Output:
    """Copies one of horovodrun's streams to ours, line by line, minus the ranks' exit records,
    horovodrun's closing traceback and mpirun's abort blocks; collects the records (shared by both
    streams' threads)."""

    def __init__(self, token: str, records: list[dict], lock: threading.Lock):
        self.marker = f"{RECORD} {token} "
        self.records, self.lock = records, lock
        self.launcher_error: list[str] = []  # horovodrun's own traceback, held back
        self.abort_blocks: list[str] = []  # mpirun's, held back (main prints them where no rank said why)

    def copy(self, source: IO[bytes], sink: IO[str]) -> None:
        held: str | None = None
        block: list[str] | None = None
        for raw in iter(source.readline, b""):
            line = raw.decode(errors="replace")
            if self.marker in line:
                self.take_record(line)
                continue
            if self.launcher_error:
                self.launcher_error.append(line)
                continue
            if block is not None:
                block.append(line)
                if is_rule(line) and len(block) > 1:
                    self.end_block(block, sink)
                    block = None
                continue
            if held is not None:
                # horovodrun's own traceback opens with its script's frame; a rank's opens with its own.
                if re.search(r'File ".*/horovodrun", line', line):
                    self.launcher_error = [held, line]
                    held = None
                    continue
                sink.write(held)
                held = None
            if line.rstrip("\r\n") == "Traceback (most recent call last):":
                held = line
                continue
            if is_rule(line):
                block = [line]
                continue
            sink.write(line)
            sink.flush()
        if held is not None:
            sink.write(held)
        if block is not None:
            sink.write("".join(block))
        sink.flush()

    def end_block(self, block: list[str], sink: IO[str]) -> None:
        text = "".join(block)
        if any(words in " ".join(text.split()) for words in MPIRUN_ABORT):
            self.abort_blocks.append(text)
            return
        sink.write(text)
        sink.flush()

    def take_record(self, line: str) -> None:
        try:
            # raw_decode: mpirun's --tag-output may have put its tag after the JSON on the same line
            record, _ = json.JSONDecoder().raw_decode(line.split(self.marker, 1)[1])
            record = {"rank": int(record["rank"]), "code": int(record["code"]), "cause": str(record["cause"])}
        except (ValueError, KeyError, TypeError, IndexError):
            return
        with self.lock:
            self.records.append(record)


def first_process(launcher_error: list[str]) -> tuple[int | None, int | None]:
    """(rank, code) of the first failed process as horovodrun's closing error names it, if it does."""
    text = "".join(launcher_error)
    name = re.search(r"Process name:\s+(\d+)", text)
    code = re.search(r"Exit code:\s+(-?\d+)", text) or re.search(r"mpirun failed with exit code (-?\d+)", text)
    return (int(name.group(1)) if name else None), (int(code.group(1)) if code else None)


def chosen_record(records: list[dict]) -> dict | None:
    """The record whose code and cause the job reports: the first rank that named a cause (ranks
    that only followed it, a lost peer, name none); where all that named one agree on the code (a
    stop every rank made), rank 0's, which names what rank 0 alone knows (the checkpoint it wrote)."""
    named = [r for r in records if r["cause"]]
    if not named:
        return records[0] if records else None
    if len({r["code"] for r in named}) == 1:
        return min(named, key=lambda r: r["rank"])
    return named[0]


def outcome(returncode: int, records: list[dict], launcher_error: list[str]) -> tuple[int, str]:
    """The code to return and the last line to print."""
    if returncode == 0 and not records:
        return 0, ""
    if not records and not launcher_error:  # mpirun's own code (horovodrun --mpi becomes mpirun), or a usage error
        return returncode, f"hvdtrain launch: exit {returncode}: no rank recorded a cause: see the output above"
    chosen = chosen_record(records)
    if chosen is not None:
        code = chosen["code"]
        meaning = MEANINGS.get(code, f"exit code {code}")
        return code, f"hvdtrain launch: exit {code} ({meaning}), rank {chosen['rank']}: {chosen['cause']}"
    rank, code = first_process(launcher_error)
    where = f"rank {rank}" if rank is not None else "a rank"
    if code is not None and (code < 0 or 128 < code <= 128 + 64):  # ended by a signal (-N, or the shell's 128 + N)
        number = -code if code < 0 else code - 128
        name = signal.Signals(number).name if number in {s.value for s in signal.Signals} else f"signal {number}"
        return 128 + number, (f"hvdtrain launch: exit {128 + number}: {where} was killed by {name} (out of memory, "
                              f"or ended from outside): see its output above")
    if code is not None and code > 0:  # a rank that left without a record: its code is still the job's
        meaning = MEANINGS.get(code, f"exit code {code}")
        return code, (f"hvdtrain launch: exit {code} ({meaning}), {where}: it recorded no cause "
                      "(a crash before hvdtrain started, or a program that is not hvdtrain's CLI): "
                      "see its output above")
    line = f"hvdtrain launch: exit 1 (a crash): {where} failed without an hvdtrain exit record: see its output above"
    if launcher_error:
        line += f"; horovodrun said: {launcher_error[-1].strip()[:300]}"
    return 1, line
