"""Launching with a deadline: a command that may start processes on other hosts (horovodrun,
mpirun, ssh) runs for at most so many seconds, and then it and everything it started are ended.

Used by the doctor's allreduce launches and ssh probes, and by benchmarks/doctor_repeat.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

# Seconds between SIGTERM and SIGKILL when a launch is ended.
GRACE_SECONDS = 5


@dataclass
class Finished:
    returncode: int | None  # None: ended at the deadline
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


def run_with_deadline(cmd: Sequence[str], seconds: float, env: dict[str, str] | None = None,
                      cwd: Path | None = None) -> Finished:
    """Run ``cmd`` for at most ``seconds``; then end it and everything it started, and reap it.

    Output goes to temporary files, not pipes: horovodrun's children (mpirun, ssh, ranks) inherit
    its stdout, and reading a pipe until EOF waits for the last of them, which is why
    ``subprocess.run(timeout=...)`` could not end a stuck launch. The command runs in a session of
    its own, so that ending it reaches processes that left its process group, e.g. the ssh
    clients that mpirun puts in groups of their own (see ``stop_launch``).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        process = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env, cwd=cwd,
                                   start_new_session=True)
        returncode = None
        try:
            returncode = process.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_launch(process)  # also after a normal exit: nothing it started may outlive it
        elapsed = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return Finished(returncode, out.read().decode(errors="replace"), err.read().decode(errors="replace"),
                        elapsed)


def launch_processes(leader: int) -> list:
    """The live processes of the launch led by ``leader``: its descendants, and whatever is still
    in its session (orphans that init adopted). Processes that made sessions of their own
    (horovodrun's per-rank middlemen call setsid) are found as descendants."""
    import psutil

    found = {}
    try:
        found = {p.pid: p for p in psutil.Process(leader).children(recursive=True)}
    except psutil.Error:
        pass
    for process in psutil.process_iter():
        try:
            if process.pid != leader and process.pid not in found and os.getsid(process.pid) == leader:
                found[process.pid] = process
        except (OSError, psutil.Error):
            continue
    return list(found.values())


def stop_launch(process: subprocess.Popen, grace: float = GRACE_SECONDS) -> None:
    """End a launch and reap its leader: SIGTERM to all of it (mpirun then has its daemons end the
    ranks; horovodrun's middlemen end their ssh clients), SIGKILL to what is left after ``grace``
    seconds. Processes seen once stay targets, even after their parent is gone."""
    import psutil

    def running(p: Any) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    known: dict[int, Any] = {}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if process.poll() is None:
            try:
                known.setdefault(process.pid, psutil.Process(process.pid))
            except psutil.Error:
                pass
        for member in launch_processes(process.pid):
            known.setdefault(member.pid, member)
        targets = [p for p in known.values() if running(p)]
        if not targets:
            break
        for p in targets:
            try:
                p.send_signal(sig)  # psutil checks that the pid still names the same process
            except psutil.Error:
                continue
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(running(p) for p in targets):
            process.poll()
            time.sleep(0.1)
    process.wait()
