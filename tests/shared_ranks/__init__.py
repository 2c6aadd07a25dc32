"""Shared launched jobs: a 2-rank job is launched for real once per launcher (horovodrun with Gloo,
mpirun with the MPI controller) and once as a plain single process, and every test job that is not
about the launch itself runs inside it (``tests.helpers.launch`` routes it here).

Why: a launched 2-rank debug run costs about 6 s here, half of it the ranks' imports (torch 1.4 s,
torch._dynamo 1.2 s more) and Horovod's start; the suite launched some 200 of them. The ranks of a
shared job pay that once. MosaicML's composer runs its world_size(2) tests inside one launched pytest
session for the same reason; Horovod runs test/parallel once under horovodrun.

What a test sees is what the launcher would have given it: the job's argv (``-m hvdtrain ...`` or a
script of tests/), working folder and environment, its exit code (horovodrun's 1 when a rank failed,
mpirun's first failing rank's code), and its output, each rank's lines prefixed as horovodrun
prefixes them. A rank that leaves with an error ends the other's job, as a launcher would.

A job runs for real instead when the shared ranks cannot stand for a fresh launch:
- the test is about the launch itself (signals, kills, placement, the launcher's own output):
  ``launch(..., own_launch=True)``, and every ``start_job`` / ``stopped_by_sigterm``;
- its program is not one that runs in a shared process: ``-m hvdtrain`` train, evaluate or bench,
  or a script that carries ``SHARED_MARK``;
- the ranks refuse it (server.OWN_LAUNCH): it starts Horovod with other settings (a longer
  timeout, the stall inspector, a timeline, elastic) or sets variables Horovod reads at its start.

HVDTRAIN_TEST_SHARED_RANKS=0 launches every job for real (to compare, or to rule the sharing out).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from itertools import count
from pathlib import Path

from .server import OWN_LAUNCH

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
# A script runs on the shared ranks when it says so in this line of its own: its work is guarded by
# __name__ == "__main__" and leaves the process as it found it (no hvd.shutdown, no os._exit, no
# patched hvdtrain function left in place, no process-wide setting of its own).
SHARED_MARK = "# tests/shared_ranks: this script may run on the shared ranks"
# The examples a user copies stay free of the suite's marks: those that pass the same rule are named here.
SHARED_EXAMPLES = {REPO / "examples" / "from_ddp" / "hvdtrain_digits.py",
                   REPO / "examples" / "from_ddp" / "spiral_hvdtrain.py"}
# `python -m hvdtrain <command>`: the commands that run a job on the ranks (no subcommand = train).
SHARED_COMMANDS = {"train", "evaluate", "bench"}
KINDS = {"horovodrun-gloo", "mpirun", "single"}
START_TIMEOUT = 300
CANCEL_GRACE = 20.0
_jobs = count()


def enabled() -> bool:
    return os.environ.get("HVDTRAIN_TEST_SHARED_RANKS", "1") != "0"


def accepts(kind: str, np_: int, program: list[str]) -> bool:
    """Whether ``program`` on ``np_`` ranks of ``kind`` may run in the shared job."""
    if not enabled() or kind not in KINDS or np_ != (1 if kind == "single" else 2) or not program:
        return False
    if program[:2] == ["-m", "hvdtrain"]:
        first = program[2] if len(program) > 2 else ""
        return first.startswith("-") or "=" in first or first in SHARED_COMMANDS  # options only: train
    if Path(program[0]).resolve() in SHARED_EXAMPLES:
        return True
    try:
        return SHARED_MARK in Path(program[0]).read_text(errors="replace")
    except OSError:
        return False


class SharedJob:
    """One launched job whose ranks run test jobs one after the other."""

    def __init__(self, kind: str, np_: int) -> None:
        self.kind, self.np = kind, np_
        self.process: subprocess.Popen | None = None
        self.ranks: list[dict] = []
        self.channels: list = []
        self.folder = Path()
        self.runs = self.fallbacks = self.restarts = 0

    # -- the launched job ----------------------------------------------------------------------------

    def start(self) -> None:
        from tests.helpers import job_env, launch_command

        self.folder = Path(tempfile.mkdtemp(prefix=f"hvdtrain-shared-{self.kind}-"))
        address = self.folder / "control.sock"
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(address))
        listener.listen(self.np)
        env = job_env(self.folder)
        env["HVDTRAIN_SHARED_CLIENT_ENV"] = json.dumps(env)
        log = open(self.folder / "server.log", "w")
        self.process = subprocess.Popen(
            launch_command(self.kind, self.np, ["-m", "tests.shared_ranks.server", str(address)]),
            cwd=self.folder, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()
        connections = []
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while len(connections) < self.np:
                # Woken by a rank's connection; the launcher's exit ends the wait at once.
                ready, _, _ = select.select([listener], [], [], 1.0)
                if ready:
                    connections.append(listener.accept()[0])
                elif self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the shared {self.kind} job did not start:\n{self.server_log()}")
        finally:
            listener.close()
        self.channels = [Channel(c) for c in connections]
        hellos = [channel.receive() for channel in self.channels]
        order = sorted(range(self.np), key=lambda i: hellos[i]["rank"])
        self.channels = [self.channels[i] for i in order]
        self.ranks = [hellos[i] for i in order]
        assert [r["rank"] for r in self.ranks] == list(range(self.np)), self.ranks
        assert all(r["size"] == self.np for r in self.ranks), self.ranks

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def server_log(self) -> str:
        try:
            return (self.folder / "server.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """Close the ranks' channels (they leave their loop and exit), then end what is left."""
        for channel in self.channels:
            try:
                channel.close()
            except OSError:
                pass
        self.channels = []
        if self.process is not None:
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_group(self.process)
            self.process = None
        shutil.rmtree(self.folder, ignore_errors=True)

    def abandon(self) -> None:
        """The job is broken (a rank died or hangs): end all of it; the next test starts a new one.
        The ranks first: horovodrun starts each in a process group of its own."""
        for rank in self.ranks:
            try:
                os.kill(rank["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.process is not None:
            kill_group(self.process)
        self.channels, self.process = [], None
        self.restarts += 1

    # -- a test job ----------------------------------------------------------------------------------

    def run(self, program: list[str], cwd: Path, env: dict[str, str],
            timeout: float) -> subprocess.CompletedProcess | None:
        """Run ``program`` on the shared ranks; None when it needs a launch of its own."""
        if not self.alive():
            self.start()
        folder = self.folder / "jobs" / str(next(_jobs))
        folder.mkdir(parents=True)
        outputs = [(folder / f"{rank}.out", folder / f"{rank}.err") for rank in range(self.np)]
        for channel, (out, err) in zip(self.channels, outputs):
            channel.send({"argv": program, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)})
        results = self.collect(timeout)
        codes = [result.get("code") for result in results]
        if OWN_LAUNCH in codes:
            assert set(codes) == {OWN_LAUNCH}, f"the ranks disagree on running the job here: {results}"
            self.fallbacks += 1
            return None
        self.runs += 1
        stdout = "".join(self.output(rank, out, "stdout") for rank, (out, _) in enumerate(outputs))
        stderr = "".join(self.output(rank, err, "stderr") for rank, (_, err) in enumerate(outputs))
        shutil.rmtree(folder, ignore_errors=True)
        leaked = sorted({name for result in results for name in result.get("threads", [])})
        if leaked:
            # A run must stop what it started (train/run.py: release): a process may start another run
            # (the Python API called twice), and the next test's job runs in this one.
            self.abandon()
            raise AssertionError(f"the job left threads running: {', '.join(leaked)}\n--- stdout\n{stdout[-3000:]}"
                                 f"\n--- stderr\n{stderr[-3000:]}")
        return subprocess.CompletedProcess(["<shared " + self.kind + ">", *program], self.exit_code(results),
                                           stdout, stderr)

    def collect(self, timeout: float) -> list[dict]:
        """Each rank's result; a rank that fails ends the others' jobs (a launcher ends them)."""
        results: list[dict | None] = [None] * self.np
        order: list[int] = []
        deadline, cancel_deadline = time.monotonic() + timeout, None
        while None in results:
            waiting = [self.channels[r] for r in range(self.np) if results[r] is None]
            limit = deadline if cancel_deadline is None else min(deadline, cancel_deadline)
            ready, _, _ = select.select(waiting, [], [], max(0.0, limit - time.monotonic()))
            if not ready:
                self.abandon()
                if cancel_deadline is not None and time.monotonic() >= cancel_deadline:
                    # A rank left the job while the other waits in a collective: a launcher would end it.
                    return [r if r is not None else {"code": 143, "cancelled": True} for r in results]
                raise subprocess.TimeoutExpired(f"shared {self.kind} job", timeout)
            for channel in ready:
                rank = self.channels.index(channel)
                message = channel.receive()
                if message is None:
                    log = self.server_log()
                    self.abandon()
                    raise RuntimeError(f"rank {rank} of the shared {self.kind} job died:\n{log}")
                results[rank] = message
                order.append(rank)
                code = results[rank].get("code")
                if code not in (0, OWN_LAUNCH, None) and cancel_deadline is None:
                    for other in range(self.np):
                        if results[other] is None:
                            os.kill(self.ranks[other]["pid"], signal.SIGUSR2)
                    cancel_deadline = time.monotonic() + CANCEL_GRACE
        self.order = order
        return results  # type: ignore[return-value]

    def exit_code(self, results: list[dict]) -> int:
        codes = [results[r]["code"] for r in self.order]
        failed = [code for code in codes if code not in (0, None)]
        if self.kind == "single":
            return codes[0]
        if self.kind == "mpirun":  # mpirun returns the first failing rank's code
            return failed[0] if failed else 0
        return 1 if failed else 0  # horovodrun: 1 when a rank failed

    def output(self, rank: int, path: Path, stream: str) -> str:
        text = path.read_text(errors="replace") if path.exists() else ""
        if not self.kind.startswith("horovodrun"):
            return text
        return "".join(f"[{rank}]<{stream}>:{line}" for line in text.splitlines(keepends=True))


class Channel:
    """One rank's end of the control socket: a JSON object per line each way."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection, self.buffer = connection, b""

    def fileno(self) -> int:
        return self.connection.fileno()

    def send(self, message: dict) -> None:
        self.connection.sendall(json.dumps(message).encode() + b"\n")

    def receive(self) -> dict | None:
        """The next message (blocking); None once the rank has closed its end."""
        while b"\n" not in self.buffer:
            chunk = self.connection.recv(65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        self.connection.close()


def kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


_shared: dict[str, SharedJob] = {}
_summary: list[str] = []


def run(kind: str, np_: int, program: list[str], cwd: Path, env: dict[str, str],
        timeout: float) -> subprocess.CompletedProcess | None:
    job = _shared.setdefault(kind, SharedJob(kind, np_))
    return job.run(program, cwd, env, timeout)


def stop_all() -> list[str]:
    """End every shared job; lines for the session's summary (of every job ended so far: a test
    that must see this process without busy children, as tests/unit/test_sysstats.py, ends them
    early and the next test that needs them starts them again)."""
    for kind, job in _shared.items():
        _summary.append(f"shared {kind} ranks: {job.runs} jobs run, {job.fallbacks} launched for real, "
                        f"{job.restarts} restarts")
        job.stop()
    _shared.clear()
    return list(_summary)
