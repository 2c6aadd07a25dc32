"""``hvdtrain launch``: horovodrun whose exit code is the ranks' own, with the cause as its last line.

``horovodrun`` returns 1 whatever code its ranks chose, and ends with a traceback of its own
(horovod/horovod#3647): a scheduler, a retry loop or CI cannot tell "checkpointed, resume me" (75)
from "bad configuration or data" (2) or a crash (1). ``hvdtrain launch`` takes horovodrun's
arguments unchanged and runs it with a random token in the job's environment. Each rank, on
leaving with a non-zero code, writes one record line with the token, its rank, its code and the
one-line cause (``exit_record``). The launcher passes every other line through, keeps the records
out of the output, drops horovodrun's own closing traceback, and ends with

    hvdtrain launch: exit 75 (stopped after a checkpoint: run the same command to resume), rank 0: ...

returning that code. The record travels in the ranks' output, which horovodrun brings back from
every host, so it works across machines; the token keeps a line that only looks like a record
(a file name in a warning, say) from being taken for one. A rank on the launcher's host also leaves
it in a file of the launcher's private folder (``record_exit``). A stop signal sent to the launcher
goes to this host's ranks once they catch it (``Forwarder``). ``mpirun`` and ``srun`` already return
the ranks' codes and need none of this.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import re
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO

from ..fault import signals
from ..train.preflight import check_train_args, hvdtrain_train_args
from .records import RECORD, RECORDS_VARIABLE, TOKEN_VARIABLE, exit_record, read_record_files, record_exit  # noqa: F401

MEANINGS = {
    1: "a crash",
    2: "bad configuration or data",
    65: "data files vanished (see bad_files.jsonl in output.dir): restore them, then run the same command",
    74: "a checkpoint did not fit on its disk: free space, then run the same command",
    75: "stopped after a checkpoint: run the same command to resume",
    130: "interrupted",
}
USAGE = """usage: python -m hvdtrain launch [horovodrun arguments] COMMAND ...

Runs horovodrun with these arguments, unchanged, and returns the ranks' exit code instead of
horovodrun's 1: 0 finished, 2 bad configuration or data, 75 stopped after a checkpoint (run the
same command to resume), 1 a crash. The last line names the cause and the rank that gave it.
An elastic job whose --host-discovery-script lists only this host starts at once (horovodrun alone
waits for a second host unless --network-interfaces is given).

example:
  python -m hvdtrain launch -np 2 -H node0:1,node1:1 python -m hvdtrain --config cfg.yaml
"""


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


class LaunchError(Exception):
    """A job that would not start as asked: one line, exit 2."""


def option_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the first of horovodrun's options ``names`` in ``argv`` (``--x V`` or ``--x=V``)."""
    for index, word in enumerate(argv):
        for name in names:
            if word == name and index + 1 < len(argv):
                return argv[index + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def is_this_host(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def one_host_elastic(argv: list[str]) -> tuple[list[str], str]:
    """horovodrun's elastic driver waits for a second host unless a network interface is named
    (``_get_min_start_hosts`` in horovod/runner/gloo_run.py): with a discovery script that lists one
    host it waits silently for the elastic timeout (10 minutes). When that one host is this one, the
    loopback interface is the right one and is named; another lone host stops the launch at once."""
    script = option_value(argv, ("--host-discovery-script",))
    if script is None or option_value(argv, ("--network-interfaces", "--network-interface")) is not None:
        return argv, ""
    try:
        found = subprocess.run([script], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return argv, ""  # horovodrun runs it too, and says what is wrong with it
    hosts = {line.strip().split(":")[0] for line in found.stdout.splitlines() if line.strip()}
    if found.returncode != 0 or len(hosts) != 1:
        return argv, ""
    host = hosts.pop()
    if is_this_host(host):
        return (["--network-interfaces", "lo", *argv],
                f"hvdtrain launch: the discovery script lists one host, this one ({host}): naming the loopback "
                "interface (--network-interfaces lo), without which horovodrun's elastic driver waits for a "
                "second host")
    raise LaunchError(f"the discovery script {script} lists one host ({host}), and horovodrun's elastic driver waits "
                      f"for a second one unless a network interface is named: add --network-interfaces NIC (the "
                      f"interface {host} is reached by, e.g. eth0; hvdtrain doctor -H {host}:1 lists them)")


def horovod_cache_writable(home: str | None = None) -> bool:
    """Whether horovodrun can keep its cache of host checks in ``~/.horovod``: it creates that folder
    there, and a HOME that does not exist or is not the user's (a shared service account, a read-only
    home on compute nodes) crashes it with a PermissionError before any rank starts."""
    folder = Path(home if home is not None else os.path.expanduser("~")) / ".horovod"
    if folder.is_dir():
        return os.access(folder, os.W_OK | os.X_OK)
    return folder.parent.is_dir() and os.access(folder.parent, os.W_OK | os.X_OK)


def without_home_cache(argv: list[str], home: str | None = None) -> tuple[list[str], str]:
    """``argv`` with ``--disable-cache`` where horovodrun could not write its cache (and a note), else as given."""
    if "--disable-cache" in argv or horovod_cache_writable(home):
        return argv, ""
    where = home if home is not None else os.path.expanduser("~")
    return (["--disable-cache", *argv],
            f"hvdtrain launch: HOME ({where}) is not writable: horovodrun runs without its cache of host checks "
            f"(--disable-cache; they run again at each start)")


RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK")  # set by horovodrun --gloo, by mpirun


def local_ranks(launcher_pid: int, token: str) -> dict[int, tuple[int, str]]:
    """The job's ranks on this host, with their loader workers (which ignore stop signals) and any
    shell a rank was started through: the launcher's descendants whose environment has the job's
    token and a rank variable, as pid -> (parent pid, rank). horovodrun, its shell and mpirun carry
    the token but no rank variable."""
    import psutil  # Horovod's own dependency; main() imports it before any signal can come

    try:
        children = psutil.Process(launcher_pid).children(recursive=True)
    except psutil.Error:
        return {}
    found = {}
    for child in children:
        try:
            environ = child.environ()
            parent = child.ppid()
        except psutil.Error:
            continue
        rank = next((environ[name] for name in RANK_VARIABLES if name in environ), None)
        if environ.get(TOKEN_VARIABLE) == token and rank is not None:
            found[child.pid] = (parent, rank)
    return found


def disposition(pid: int, signum: int, proc: Path = Path("/proc")) -> str:
    """What process ``pid`` does with ``signum`` now: ``caught`` (a handler), ``ignored`` or
    ``default`` (ends on it), from ``SigCgt``/``SigIgn`` of its status. A rank just started is still
    importing Python, and hvdtrain's handler comes with its first line (fault/signals.py). A
    process that is gone counts as ``caught``: nothing to wait for."""
    try:
        status = (proc / str(pid) / "status").read_text()
    except OSError:
        return "caught"
    masks = dict(re.findall(r"^(SigCgt|SigIgn):\s*([0-9a-fA-F]+)$", status, re.MULTILINE))
    bit = 1 << (signum - 1)
    if int(masks.get("SigCgt", "0"), 16) & bit:
        return "caught"
    return "ignored" if int(masks.get("SigIgn", "0"), 16) & bit else "default"


def host_slots(argv: list[str]) -> list[tuple[str, int]] | None:
    """The hosts horovodrun starts ranks on, in order, with their slots (-H, --hosts, --hostfile);
    None where a discovery script decides; no option: this host (horovodrun's default, localhost)."""
    if option_value(argv, ("--host-discovery-script",)) is not None:
        return None
    listed = option_value(argv, ("-H", "--hosts"))
    if listed is not None:
        return [(entry.split(":")[0], slots(entry.split(":", 1)[1] if ":" in entry else "1"))
                for entry in listed.split(",") if entry]
    hostfile = option_value(argv, ("--hostfile", "-hostfile"))
    if hostfile is not None:
        try:
            lines = Path(hostfile).read_text().splitlines()
        except OSError:
            return None
        words = [line.split() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        return [(word[0], next((slots(w.split("=", 1)[1]) for w in word[1:] if w.startswith("slots=")), 1))
                for word in words]
    return [("localhost", slots(option_value(argv, ("-np", "--num-proc")) or "1"))]


def slots(text: str) -> int:
    return int(text) if text.strip().isdigit() else 1


def ranks_expected_here(argv: list[str]) -> int | None:
    """How many ranks horovodrun starts on this host: the hosts fill in order, up to -np in all
    (None where a discovery script decides)."""
    hosts = host_slots(argv)
    if hosts is None:
        return None
    left = slots(option_value(argv, ("-np", "--num-proc")) or str(sum(count for _, count in hosts)))
    here = 0
    for host, count in hosts:
        taken = min(count, left)
        left -= taken
        if is_this_host(host):
            here += taken
    return here


class Forwarder:
    """Hands a stop signal the launcher gets (a scheduler's, a batch script's) to this host's ranks,
    which agree on it with the others and checkpoint: horovodrun would end them instead (under
    mpirun within a second, under Gloo within 5 s). With no rank on this host, horovodrun gets it.

    The handler only writes the signal's number into a pipe; a thread of its own does the rest.
    A second signal while the first is handled (a batch shell and its helper step both passing
    one on, ``scontrol requeue``) is absorbed: the ranks are stopping already; but a second Ctrl-C
    interrupts at once, as it does a single process (exit 130). Ranks still starting
    get the signal once all of this host's have started and catch it (``disposition``): until then
    it would end them, and one that has not started would only hear of the stop from the others."""

    READY_WAIT_SECONDS = 30.0  # a program that never catches it (not hvdtrain's CLI) gets it then

    def __init__(self, job: subprocess.Popen, token: str, expected_here: int | None) -> None:
        self.job, self.token, self.expected_here = job, token, expected_here
        self.ranks_here = expected_here is None or expected_here > 0
        self.read_end, self.write_end = os.pipe()
        self.first: int | None = None
        self.thread = threading.Thread(target=self.run, name="hvdtrain-launch-forward", daemon=True)

    def handler(self, signum: int, _frame) -> None:
        with contextlib.suppress(OSError):
            os.write(self.write_end, bytes([signum]))

    def start(self) -> "Forwarder":
        self.thread.start()
        return self

    def run(self) -> None:
        while True:
            signum = self.next_signal(None)
            if signum is None:
                return
            if self.first is None:
                self.first = signum
                self.deliver(signum)
            else:
                self.again(signum)

    def next_signal(self, timeout: float | None) -> int | None:
        """The next signal the handler wrote (None: none within ``timeout``, or the pipe closed)."""
        if timeout is not None and not select.select([self.read_end], [], [], timeout)[0]:
            return None
        try:
            data = os.read(self.read_end, 1)
        except OSError:
            return None
        return data[0] if data else None

    def again(self, signum: int) -> None:
        """A signal after the first: absorbed, but for a second Ctrl-C, which interrupts at once
        (the ranks' own second SIGINT, and horovodrun's: exit 130, no checkpoint)."""
        if signum == signal.SIGINT and self.first == signal.SIGINT and self.job.poll() is None:
            self.kill(list(local_ranks(self.job.pid, self.token)), signum)
            with contextlib.suppress(OSError):
                self.job.send_signal(signum)

    def deliver(self, signum: int) -> None:
        """Once every rank here catches ``signum`` (the innermost processes of the ranks' trees: a
        shell a rank runs under waits for its Python), it goes to the processes that catch it; a
        shell is left alone (ending it would end its rank)."""
        deadline = time.monotonic() + self.READY_WAIT_SECONDS
        while self.job.poll() is None:
            ranks = local_ranks(self.job.pid, self.token) if self.ranks_here else {}
            parents = {parent for parent, _ in ranks.values()}
            innermost = [pid for pid in ranks if pid not in parents]
            started = len({rank for _, rank in ranks.values()})
            # Whether a rank is ready is read from SIGTERM, whatever the signal: hvdtrain catches the
            # stop signals together on its first line, while Python catches SIGINT from its own start
            # (KeyboardInterrupt, which would end a rank still importing).
            if innermost and started >= (self.expected_here or 1) \
                    and all(self.ready(pid, ranks, signal.SIGTERM) for pid in innermost):
                self.kill([pid for pid in ranks if disposition(pid, signal.SIGTERM) == "caught"], signum)
                return
            if not self.ranks_here or time.monotonic() > deadline:
                self.kill(list(ranks), signum)
                if not ranks:
                    with contextlib.suppress(OSError):
                        self.job.send_signal(signum)
                return
            later = self.next_signal(0.05)  # ranks still starting: /proc says when they catch it
            if later is not None:
                self.again(later)
                if later == signal.SIGINT and self.first == signal.SIGINT:
                    return

    @staticmethod
    def ready(pid: int, ranks: dict[int, tuple[int, str]], signum: int) -> bool:
        """A rank's process catches the signal; a loader worker (a rank's child) ignores it while
        its rank catches it."""
        here = disposition(pid, signum)
        if here == "caught":
            return True
        parent = ranks[pid][0]
        return here == "ignored" and parent in ranks and disposition(parent, signum) == "caught"

    @staticmethod
    def kill(pids: list[int], signum: int) -> None:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signum)

    def close(self) -> None:
        os.close(self.write_end)
        self.thread.join(timeout=5)
        os.close(self.read_end)


def stop_before_start() -> str | None:
    """A stop asked for before horovodrun starts (caught during the launcher's own start-up, or the
    batch script's stop file): its signal's name, else None."""
    caught = signals.caught()
    if caught is not None:
        return signal.Signals(caught).name
    named = signals.stop_file_signal()
    return f"SIG{named} (to the batch script)" if named else None


# horovodrun's options that take no value (horovod/runner/launch.py's store_true and override
# actions); every other option takes the next word, unless written --option=value.
HOROVODRUN_FLAGS = frozenset({
    "--autotune", "--no-autotune", "--check-build", "-cb", "--disable-cache", "--gloo", "--mpi", "--jsrun",
    "--tcp", "--verbose", "--version", "--hierarchical-allgather", "--no-hierarchical-allgather",
    "--hierarchical-allreduce", "--no-hierarchical-allreduce", "--torus-allreduce", "--no-torus-allreduce",
    "--log-hide-timestamp", "--no-log-hide-timestamp", "--log-with-timestamp", "--log-without-timestamp",
    "--prefix-output-with-timestamp", "-prefix-timestamp", "--mpi-threads-disable", "--no-mpi-threads-disable",
    "--stall-check", "--no-stall-check", "--timeline-mark-cycles", "--no-timeline-mark-cycles"})


def horovodrun_command(argv: list[str]) -> list[str]:
    """The command horovodrun's arguments start (what follows its options and their values)."""
    index = 0
    while index < len(argv) and argv[index].startswith("-"):
        option = argv[index]
        index += 1 if option in HOROVODRUN_FLAGS or "=" in option else 2
    return argv[index:]


def end_with_parent() -> None:
    """In horovodrun's process, before it starts: SIGTERM when this launcher dies (Linux's
    PR_SET_PDEATHSIG), since it no longer shares the launcher's process group and so its signals."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def horovodrun() -> str:
    beside = Path(sys.executable).with_name("horovodrun")
    return str(beside) if beside.exists() else "horovodrun"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0 if argv else 2
    try:
        argv, note = one_host_elastic(argv)
    except LaunchError as error:
        print(f"hvdtrain launch: error: {error}", file=sys.stderr, flush=True)
        return 2
    train_args = hvdtrain_train_args(horovodrun_command(argv))
    if train_args is not None:
        # The config of the hvdtrain command it starts, checked as its ranks will check it (the
        # model's parameter names included, train/preflight.py): a mistake is one line, before
        # horovodrun has started a rank, in the launcher's own last line (exit 2).
        try:
            check_train_args(train_args, "hvdtrain launch ... python -m hvdtrain", own_tasks=False)
        except Exception as error:
            from ..outcome import user_errors

            if not isinstance(error, user_errors()):
                raise
            print(f"hvdtrain launch: exit 2 ({MEANINGS[2]}), before any rank started: error: {error}",
                  file=sys.stderr, flush=True)
            return 2
    argv, cache_note = without_home_cache(argv)
    for line in (note, cache_note):
        if line:
            print(line, file=sys.stderr, flush=True)
    import psutil  # noqa: F401 - loaded now: a signal handled while it loads would find it half-made

    early = stop_before_start()
    if early:
        print(f"hvdtrain launch: exit 75 (stopped before the ranks started, by {early}: nothing to "
              f"checkpoint; run the same command to resume)", file=sys.stderr, flush=True)
        return 75
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="hvdtrain-launch-") as folder:  # mode 700: this user's alone
        return launch(argv, token, Path(folder))


def launch(argv: list[str], token: str, records_folder: Path) -> int:
    """horovodrun with ``argv``, its output copied, the stop signals handed on: the code to return."""
    env = {**os.environ, TOKEN_VARIABLE: token, RECORDS_VARIABLE: str(records_folder)}
    try:
        # horovodrun in a process group of its own: a terminal's Ctrl-C reaches this launcher alone,
        # which passes it on as SIGINT to the ranks (below); horovodrun would end them with SIGTERM,
        # and their stop line would name the wrong signal. It still ends with this launcher.
        job = subprocess.Popen([horovodrun(), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               process_group=0, preexec_fn=end_with_parent)
    except OSError as error:
        print(f"hvdtrain launch: error: cannot start horovodrun ({error}): is Horovod installed (make setup)?",
              file=sys.stderr, flush=True)
        return 2
    # A stop signal sent to the launcher alone (a scheduler's, a batch script's, a Ctrl-C) goes to
    # this host's ranks, which agree on it with the others, checkpoint and name it (the Forwarder).
    forwarder = Forwarder(job, token, ranks_expected_here(argv)).start()
    previous = {s: signal.signal(s, forwarder.handler) for s in signals.STOP_SIGNALS}
    caught = signals.caught()  # between the check above and the handler
    if caught is not None:
        forwarder.handler(caught, None)
    records: list[dict] = []
    lock = threading.Lock()
    out, err = Output(token, records, lock), Output(token, records, lock)
    pumps = [threading.Thread(target=out.copy, args=(job.stdout, sys.stdout), daemon=True),
             threading.Thread(target=err.copy, args=(job.stderr, sys.stderr), daemon=True)]
    for pump in pumps:
        pump.start()
    try:
        while True:
            try:
                returncode = job.wait()
                break
            except KeyboardInterrupt:  # a Ctrl-C before the handler was set: the ranks stop, wait for them
                continue
        for pump in pumps:
            pump.join()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        forwarder.close()
    records = merged(records, read_record_files(records_folder))
    code, line = outcome(returncode, records, out.launcher_error + err.launcher_error)
    if not any(record["cause"] for record in records):  # nothing of hvdtrain's own says why: mpirun's words
        for block in out.abort_blocks + err.abort_blocks:
            sys.stderr.write(block)
    if line:
        print(line, file=sys.stderr, flush=True)
    return code
