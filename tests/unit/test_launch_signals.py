"""A stop signal at any moment of a job's life: ``hvdtrain launch`` hands it to a rank once the rank
catches it, absorbs a repeat, and stops before starting anything when the stop came first; the
ranks' own early catch (fault/signals.py). horovodrun is a stand-in here (a script that starts one
"rank"); tests/parallel/test_launch.py and tests/multinode/test_slurm_requeue.py run the real ones."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from hvdtrain.fault import signals
from hvdtrain.launch import horovodrun as launch

REPO = Path(__file__).resolve().parents[2]

# horovodrun's stand-in: starts the rank with a rank variable and SIGTERM's default action (as mpirun
# and horovodrun's Gloo start their ranks, whatever the launcher ignores), returns its code.
FAKE_HOROVODRUN = f"""#!{sys.executable}
import os, signal, subprocess, sys
rank = subprocess.Popen([sys.executable, os.environ["RANK_SCRIPT"]], env={{**os.environ, "HOROVOD_RANK": "0"}},
                        preexec_fn=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL),
                        stderr=subprocess.DEVNULL if os.environ.get("DROP_OUTPUT") else None)
sys.exit(rank.wait())
"""
# The rank: no handler until the test says "go" (a rank still importing), then it counts the stop
# signals it gets, and leaves with 75 and its exit record, as hvdtrain's ranks do.
RANK = """
import os, signal, sys, time
from pathlib import Path
from hvdtrain.launch.horovodrun import record_exit
log = Path(os.environ["LOG"])
log.write_text("started\\n")
while not Path(os.environ["GO"]).exists():
    time.sleep(0.01)
got = []
signal.signal(signal.SIGTERM, lambda *_: got.append(1))
with log.open("a") as out:
    out.write("ready\\n")
while not got:
    time.sleep(0.01)
time.sleep(0.5)  # a second signal, had one been sent, arrives meanwhile
with log.open("a") as out:
    out.write(f"got {len(got)}\\n")
record_exit(0, 75, "stopped by SIGTERM")
sys.exit(75)
"""
LAUNCHER = ("import sys; from hvdtrain.fault import signals; signals.catch(); "
            "from hvdtrain.launch import horovodrun as l; l.horovodrun = lambda: sys.argv[1]; "
            "sys.exit(l.main(sys.argv[2:]))")


# A rank as hvdtrain's are with the default loader: it catches the stop signals first thing, and its
# loader workers come from a forkserver, a child of the rank that keeps SIGTERM's default action and
# never catches it, whose children (the workers) ignore it. The workers end when the server does.
RANK_WITH_FORKSERVER = """
import os, signal, subprocess, sys, time
from pathlib import Path
from hvdtrain.fault import signals
from hvdtrain.launch.horovodrun import record_exit
signals.catch()
log = Path(os.environ["LOG"])
worker = ("import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
          f"open({str(log)!r}, 'a').write('worker '); sys.stdin.read()")
server = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; "
                           f"subprocess.Popen([sys.executable, '-c', {worker!r}], stdin=subprocess.PIPE).wait()"])
while "worker" not in log.read_text():
    time.sleep(0.01)
with log.open("a") as out:
    out.write("ready\\n")
while signals.caught() is None:
    time.sleep(0.01)
server.kill()
record_exit(0, 75, "stopped by SIGTERM")
sys.exit(75)
"""


def start_launcher(tmp_path: Path, rank: str = RANK, **extra: str) -> subprocess.Popen:
    fake = tmp_path / "horovodrun"
    fake.write_text(FAKE_HOROVODRUN)
    fake.chmod(0o755)
    (tmp_path / "rank.py").write_text(rank)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "RANK_SCRIPT": str(tmp_path / "rank.py"),
           "LOG": str(tmp_path / "log"), "GO": str(tmp_path / "go"), **extra}
    return subprocess.Popen([sys.executable, "-c", LAUNCHER, str(fake), "-np", "1", "-H", "localhost:1", "x"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: Path, text: str, job: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        assert job.poll() is None, job.communicate()
        time.sleep(0.02)
    raise AssertionError(f"no '{text}' in {path}")


def test_a_repeated_stop_during_a_ranks_start_up_reaches_it_once_it_catches_it(tmp_path):
    job = start_launcher(tmp_path)
    try:
        wait_for(tmp_path / "log", "started", job)
        job.send_signal(signal.SIGTERM)  # twice within 100 ms, while the rank cannot catch it yet
        job.send_signal(signal.SIGTERM)
        time.sleep(0.3)  # the launcher must hold it back: delivered now, it would end the rank
        (tmp_path / "go").touch()
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 75, err
    assert (tmp_path / "log").read_text().splitlines() == ["started", "ready", "got 1"]
    assert err.strip().splitlines()[-1] == ("hvdtrain launch: exit 75 (stopped after a checkpoint: run the same "
                                            "command to resume), rank 0: stopped by SIGTERM")
    assert "Traceback" not in err


def test_a_ranks_exit_record_reaches_the_launcher_when_its_output_is_lost(tmp_path):
    """mpirun told to end (Slurm's SIGTERM to every process of a requeued job) drops what its ranks
    print while it waits to end them: the record the rank leaves in the launcher's folder still
    gives the code and the cause."""
    job = start_launcher(tmp_path, DROP_OUTPUT="1")
    wait_for(tmp_path / "log", "started", job)
    (tmp_path / "go").touch()
    wait_for(tmp_path / "log", "ready", job)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 75, err
    assert err.strip().splitlines()[-1].endswith("rank 0: stopped by SIGTERM")


def test_a_stop_goes_to_a_rank_at_once_whatever_its_loader_workers_parent(tmp_path):
    """Loader workers started by a forkserver are its children, and the server never catches the stop
    signals: counted as part of the rank, it held the signal back for READY_WAIT_SECONDS (30 s).
    The rank's helpers carry its PID and are left out; the launcher says the signal went at once."""
    (tmp_path / "log").write_text("")
    job = start_launcher(tmp_path, RANK_WITH_FORKSERVER)
    try:
        wait_for(tmp_path / "log", "ready", job)
        job.send_signal(signal.SIGTERM)
        _, err = job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode == 75, err
    assert "hvdtrain launch: SIGTERM passed on to rank 0 on this host at once, all of them catching it" in \
        err.splitlines(), err
    assert err.strip().splitlines()[-1].endswith("rank 0: stopped by SIGTERM")


def test_a_ranks_helpers_are_no_ranks_of_their_own(tmp_path, monkeypatch):
    """What ``local_ranks`` counts: the rank (and a shell above it), not the processes that carry
    its PID as the stop signals' taker; the launcher's own PID in a rank's environment changes nothing."""
    import psutil

    class Child:
        def __init__(self, pid, ppid, **environ):
            self.pid, self._ppid, self._environ = pid, ppid, {"HVDTRAIN_LAUNCH_TOKEN": "t", **environ}

        def environ(self):
            return self._environ

        def ppid(self):
            return self._ppid

    assert launch.TOKEN_VARIABLE == "HVDTRAIN_LAUNCH_TOKEN"
    taker = signals.TAKER_VARIABLE
    children = [Child(10, 1, HOROVOD_RANK="0"),                                    # a shell
                Child(11, 10, HOROVOD_RANK="0", **{taker: "1"}),                   # the rank, launcher's PID
                Child(12, 11, HOROVOD_RANK="0", **{taker: "11"}),                  # its forkserver
                Child(13, 12, HOROVOD_RANK="0", **{taker: "11"}),                  # a loader worker
                Child(14, 11, HOROVOD_RANK="0"),                                   # a worker it forked
                Child(20, 1, OMPI_COMM_WORLD_RANK="1", **{taker: "20"}),           # a rank that is its own
                Child(30, 1)]                                                      # mpirun: no rank
    monkeypatch.setattr(psutil.Process, "children", lambda self, recursive: children)
    assert launch.local_ranks(os.getpid(), "t") == {10: (1, "0"), 11: (10, "0"), 14: (11, "0"), 20: (1, "1")}


def test_a_stop_before_the_launch_ends_it_with_75_and_starts_nothing(tmp_path):
    stop = tmp_path / "stop"
    stop.write_text("TERM\n")
    job = start_launcher(tmp_path, HVDTRAIN_STOP_FILE=str(stop))
    _, err = job.communicate(timeout=60)
    assert job.returncode == 75 and not (tmp_path / "log").exists()
    assert err.strip() == ("hvdtrain launch: exit 75 (stopped before the ranks started, by SIGTERM (to the batch "
                           "script): nothing to checkpoint; run the same command to resume)")


def test_what_a_process_does_with_a_signal_comes_from_its_status(tmp_path):
    status = tmp_path / "7" / "status"
    status.parent.mkdir()
    status.write_text("Name:\tpython\nSigIgn:\t0000000000000000\nSigCgt:\t0000000000000000\n")
    assert launch.disposition(7, signal.SIGTERM, proc=tmp_path) == "default"
    status.write_text("SigIgn:\t0000000000000000\nSigCgt:\t0000000000004000\n")  # bit 15: SIGTERM
    assert launch.disposition(7, signal.SIGTERM, proc=tmp_path) == "caught"
    assert launch.disposition(7, signal.SIGUSR1, proc=tmp_path) == "default"
    status.write_text("SigIgn:\t0000000000000200\nSigCgt:\t0000000000000000\n")  # SIGUSR1 ignored (a loader worker)
    assert launch.disposition(7, signal.SIGUSR1, proc=tmp_path) == "ignored"
    assert launch.disposition(8, signal.SIGTERM, proc=tmp_path) == "caught"  # gone: nothing to wait for


def test_the_launch_says_how_many_ranks_start_on_this_host(tmp_path, monkeypatch):
    monkeypatch.setattr(launch, "is_this_host", lambda host: host in ("localhost", "node0"))
    assert launch.host_slots(["-np", "3", "-H", "node0:2,b:2", "python"]) == [("node0", 2), ("b", 2)]
    assert launch.ranks_expected_here(["-np", "3", "-H", "node0:2,b:2", "python"]) == 2
    assert launch.ranks_expected_here(["-np", "3", "-H", "b:2,node0:2", "python"]) == 1  # hosts fill in order
    assert launch.ranks_expected_here(["-np", "2", "-H", "b:2,c:2", "python"]) == 0
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# comment\nnode0 slots=2\n\nnode1 slots=2\n")
    assert launch.host_slots(["--hostfile", str(hostfile), "python"]) == [("node0", 2), ("node1", 2)]
    assert launch.ranks_expected_here(["-np", "4", "--hostfile", str(hostfile), "python"]) == 2
    assert launch.ranks_expected_here(["-np", "2", "python"]) == 2  # no hosts: all on this one
    assert launch.ranks_expected_here(["--host-discovery-script", "x.sh", "python"]) is None


CAUGHT = textwrap.dedent("""
    import os, signal, sys, time
    from hvdtrain.fault import signals
    signals.catch()
    os.kill(os.getpid(), signal.SIGUSR1)  # during start-up: kept, not fatal
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.1)
    print(signals.caught() == signal.SIGUSR1, flush=True)
    if sys.argv[1] == "release":
        signals.release()  # a command that does not train: it ends on the signal, as it would have
        time.sleep(5)
    """)


def test_a_stop_during_start_up_is_kept_for_the_loop_or_delivered_again():
    kept = subprocess.run([sys.executable, "-c", CAUGHT, "keep"], capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(REPO)})
    assert (kept.returncode, kept.stdout) == (0, "True\n"), kept.stderr
    released = subprocess.run([sys.executable, "-c", CAUGHT, "release"], capture_output=True, text=True, timeout=60,
                              env={"PYTHONPATH": str(REPO)})
    assert released.returncode == -signal.SIGUSR1 and released.stdout == "True\n"


def test_the_run_folder_is_told_to_the_batch_script_and_never_through_a_link(tmp_path):
    env = {signals.STOP_FILE_VARIABLE: str(tmp_path / "stop")}
    signals.tell_batch_script("runs/x", env)
    assert (tmp_path / "run_dir").read_text() == str(Path("runs/x").absolute())
    (tmp_path / "run_dir").unlink()
    (tmp_path / "elsewhere").write_text("kept")
    (tmp_path / "run_dir").symlink_to(tmp_path / "elsewhere")
    signals.tell_batch_script("runs/x", env)
    assert (tmp_path / "elsewhere").read_text() == "kept"
    signals.tell_batch_script("runs/x", {})  # no batch script: nothing


def test_the_batch_scripts_stop_file_names_the_signal(tmp_path):
    stop = tmp_path / "stop"
    env = {signals.STOP_FILE_VARIABLE: str(stop)}
    assert signals.stop_file_signal(env) is None and signals.stop_file_signal({}) is None
    stop.write_text("USR1\n")
    assert signals.stop_file_signal(env) == "USR1"
    stop.write_text("$(rm -rf /)")
    assert signals.stop_file_signal(env) == "TERM"


def test_a_term_the_moment_a_rank_starts_waits_for_its_handler(tmp_path):
    """A SIGTERM sent the moment the process exists (Popen has returned: the interpreter has not run
    a line). Started bare, the interpreter ends on it; started with the stop signals blocked, as the
    batch scripts start hvdtrain (``env --block-signal=TERM,USR1``; here the test blocks them too,
    for the instant before env does), the signal waits until hvdtrain's first line has installed
    its handler and unblocked them: the run stops at its first step with a checkpoint, exit 75."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HVDTRAIN_CACHE": str(tmp_path / "cache")}
    env.pop("HVDTRAIN_STOP_FILE", None)
    train = [sys.executable, "-m", "hvdtrain", "--config", "debug", "data.synthetic=true", "train.epochs=1"]
    bare = subprocess.Popen([*train, f"output.dir={tmp_path / 'bare'}"], env=env, stderr=subprocess.PIPE, text=True)
    bare.send_signal(signal.SIGTERM)
    assert bare.wait(timeout=60) == -signal.SIGTERM  # the window the blocked start closes
    bare.stderr.close()
    blocked = ["env", "--block-signal=TERM,USR1"]
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    try:
        rank = subprocess.Popen([*blocked, *train, f"output.dir={tmp_path / 'run'}"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
    rank.send_signal(signal.SIGTERM)
    output, _ = rank.communicate(timeout=300)
    assert rank.returncode == 75, output
    stop_line = "hvdtrain: stopped by SIGTERM in epoch 1/1 at step 0/4 (global step 0); checkpoint saved to"
    assert stop_line in output, output
    assert (tmp_path / "run" / "checkpoints" / "last.pt").exists()
    # env blocks both for what it starts (the kernel's SigBlk: bit 14 SIGTERM, bit 9 SIGUSR1)...
    shown = subprocess.run([*blocked, "grep", "SigBlk", "/proc/self/status"], capture_output=True, text=True)
    mask = int(shown.stdout.split()[1], 16)
    assert mask & (1 << (signal.SIGTERM - 1)) and mask & (1 << (signal.SIGUSR1 - 1)), shown.stdout
    # ... and hvdtrain unblocks them, whatever it was started with: handlers set over an ignored
    # signal too, and the children it starts (loader workers) get no blocked mask.
    shown = subprocess.run([*blocked, "env", "--ignore-signal=TERM", sys.executable, "-c",
                            "from hvdtrain.fault import signals; import signal; signals.catch(); "
                            "print(signal.getsignal(signal.SIGTERM).__name__, "
                            "signal.pthread_sigmask(signal.SIG_BLOCK, []))"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert shown.stdout.strip() == "_record set()", shown
