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

import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..config import ConfigError
from ..fault import signals
from ..train.preflight import adasum_problem, check_train_args, hvdtrain_train_args
from .forwarding import RANK_VARIABLES, Forwarder, disposition, local_ranks  # noqa: F401
from .records import (  # noqa: F401 - the records' names, here where they have always been found
    MEANINGS,
    MPIRUN_ABORT,
    RECORD,
    RECORDS_VARIABLE,
    TOKEN_VARIABLE,
    Output,
    chosen_record,
    exit_record,
    first_process,
    is_rule,
    merged,
    outcome,
    read_record_files,
    record_exit,
)

USAGE = """usage: python -m hvdtrain launch [horovodrun arguments] COMMAND ...

Runs horovodrun with these arguments, unchanged, and returns the ranks' exit code instead of
horovodrun's 1: 0 finished, 2 bad configuration or data, 75 stopped after a checkpoint (run the
same command to resume), 1 a crash. The last line names the cause and the rank that gave it.
An elastic job whose --host-discovery-script lists only this host starts at once (horovodrun alone
waits for a second host unless --network-interfaces is given).

example:
  python -m hvdtrain launch -np 2 -H node0:1,node1:1 python -m hvdtrain --config cfg.yaml
"""


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
    command = horovodrun_command(argv)
    train_args = hvdtrain_train_args(command)
    if train_args is not None:
        # The config of the hvdtrain command it starts, checked as its ranks will check it (the
        # model's parameter names included, train/preflight.py): a mistake is one line, before
        # horovodrun has started a rank, in the launcher's own last line (exit 2).
        try:
            cfg = check_train_args(train_args, "hvdtrain launch ... python -m hvdtrain", own_tasks=False)
            if cfg is not None and cfg.dist.op == "adasum" and "--gloo" in argv[:len(argv) - len(command)]:
                raise ConfigError(adasum_problem("gloo", {"mpi": True}, 1, 1, gpu=False))
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
    env.pop(signals.TAKER_VARIABLE, None)  # this launcher's: its ranks are no helpers of it
    try:
        # horovodrun in a process group of its own: a terminal's Ctrl-C reaches this launcher alone,
        # which passes it on as SIGINT to the ranks (below); horovodrun would end them with SIGTERM,
        # and their stop line would name the wrong signal. It still ends with this launcher.
        job = subprocess.Popen([horovodrun(), *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               process_group=0, preexec_fn=end_with_parent)
    except OSError as error:
        print(f"hvdtrain launch: error: cannot start horovodrun ({error}): install Horovod with make setup, or "
              "launch with torchrun and dist.engine=torch (docs/launching.md#two-engines)", file=sys.stderr, flush=True)
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
