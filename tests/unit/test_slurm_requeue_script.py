"""hostfiles/slurm/requeue.sh without Slurm: a stand-in scontrol records the requeue; the command is a
small shell script. (tests/multinode/test_slurm_requeue.py runs the batch scripts on a real Slurm.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from hvdtrain.fault.attempts import exit_of, job_identity

REQUEUE = Path(__file__).resolve().parents[2] / "hostfiles" / "slurm" / "requeue.sh"
# Exits with $CODE after $TICKS tenths of a second, or with 75 once it gets SIGUSR1 (as the ranks do
# after their checkpoint), saying each SIGUSR1 it got and what the stop file holds. It writes the run
# folder into the stop folder first, as hvdtrain's rank 0 does once every rank has started (unless
# NO_RUN_DIR is set: ranks still starting).
COMMAND = """trap 'echo got USR1 >> "$LOG"; stop=1' USR1
[ -n "${NO_RUN_DIR:-}" ] || printf '%s' "$RUN_DIR" > "$HVDTRAIN_STOP_DIR/run_dir"
echo started >> "$LOG"; stop=0; i=0
while ((stop == 0 && i < TICKS)); do
    if [ -n "${READ_STOP_FILE:-}" ] && [ -s "$HVDTRAIN_STOP_FILE" ]; then
        echo "read the stop file" >> "$LOG"; stop=1
    fi
    sleep 0.1 & wait $!; i=$((i + 1))
done
if ((stop)); then
    echo "stop file: $(cat "$HVDTRAIN_STOP_FILE")" >> "$LOG"
    sleep 0.3 & wait $!  # a second signal, had one been passed on, arrives meanwhile
    exit 75
fi
exit $CODE"""
# The batch scripts' first lines: a stop signal is kept from the start (here: until the file "go").
EARLY = ('stop_signal=""; trap \'stop_signal=${stop_signal:-TERM}\' TERM; '
         'trap \'stop_signal=${stop_signal:-USR1}\' USR1; '
         'echo waiting >> "$LOG"; while [ ! -e "$GO" ]; do sleep 0.05 & wait $! || true; done; ')
# scontrol: records its calls but `show`; `requeue` fails with REQUEUE_FAILS set, else Slurm's restart
# count goes up by one; `show job` says JobState=$STATE, TimeLimit=$TIME_LIMIT, StartTime=$START_TIME,
# EndTime=$END_TIME, PreemptTime=$PREEMPT_TIME and that count (or $SHOWN_RESTARTS), or nothing with
# SHOW_SILENT set (a busy slurmctld; "until-requeue": until a requeue was asked).
SCONTROL = """#!/bin/sh
if [ "$1 $2" = "show hostnames" ]; then echo node7; exec seq -f "node%g" 8 40000; fi  # a large allocation
if [ "$1" = show ]; then
    if [ "${SHOW_SILENT:-}" = always ] || { [ "${SHOW_SILENT:-}" = until-requeue ] && [ ! -e "$LOG.asked" ]; }; then
        echo "slurm_load_jobs error: Socket timed out on send/recv operation" >&2; exit 1
    fi
    echo "JobId=42 JobName=x"; echo "   JobState=${STATE:-RUNNING} Reason=None"
    restarts=${SLURM_RESTART_COUNT:-0}; [ -e "$LOG.requeued" ] && restarts=$((restarts + 1))
    echo "   Requeue=1 Restarts=${SHOWN_RESTARTS:-$restarts} BatchFlag=1 Reboot=0 ExitCode=0:0"
    echo "   RunTime=00:01:00 TimeLimit=${TIME_LIMIT:-UNLIMITED} TimeMin=N/A"
    echo "   StartTime=${START_TIME:-2026-11-29T08:00:00} EndTime=${END_TIME:-Unknown} Deadline=N/A"
    echo "   PreemptEligibleTime=2026-11-29T08:00:00 PreemptTime=${PREEMPT_TIME:-None}"; exit 0
fi
echo "scontrol $*" >> "$LOG"
[ "$1" = requeue ] && touch "$LOG.asked"
if [ "$1" = requeue ] && [ -n "${REQUEUE_FAILS:-}" ]; then echo "$REQUEUE_FAILS" >&2; exit 1; fi
[ "$1" = requeue ] && touch "$LOG.requeued"
exit 0
"""


def start(tmp_path: Path, code: int, restarts: int | None = None, most: int | None = None,
          ticks: int = 100, early: bool = False, forward_after: int = 0, command_text: str = COMMAND,
          quiet_stops: bool = False, **extra: str) -> subprocess.Popen:
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": "42", "LOG": str(tmp_path / "log"),
           "answer_pause": "0.01", "CODE": str(code), "TICKS": str(ticks), "GO": str(tmp_path / "go"),
           "RUN_DIR": str(tmp_path / "runs" / "hvdtrain 42"), **extra}
    if restarts is not None:
        env["SLURM_RESTART_COUNT"] = str(restarts)
    if most is not None:
        env["HVDTRAIN_MAX_REQUEUES"] = str(most)
    command = tmp_path / "command.sh"
    command.write_text(command_text + "\n")
    script = (f'set -euo pipefail; {EARLY if early else ""}source "{REQUEUE}"; '
              f'job_script=train.sbatch job_args=" --config debug"; '
              f'{"quiet_stops=1 " if quiet_stops else ""}forward_after={forward_after} run_and_requeue USR1 '
              f'bash "{command}"')
    # A session of its own: a test may signal every process of the "job", as Slurm does.
    return subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def log(tmp_path: Path) -> list[str]:
    path = tmp_path / "log"
    return path.read_text().splitlines() if path.exists() else []


def wait_for_log(tmp_path: Path, line: str, shell: subprocess.Popen) -> None:
    """Wait for ``line`` in the log, and for the batch shell to have trapped both stop signals (it
    sets its traps just after starting the command, which may write first)."""
    deadline = time.monotonic() + 30
    wanted = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGUSR1 - 1))
    while line not in log(tmp_path) or int(status(shell.pid).get("SigCgt", "0"), 16) & wanted != wanted:
        assert time.monotonic() < deadline and shell.poll() is None, (log(tmp_path), shell.poll())
        time.sleep(0.02)


def status(pid: int) -> dict[str, str]:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in lines if ":\t" in line)


def stopped(tmp_path: Path, sent: signal.Signals, **extra: str) -> tuple[int, str, list[str]]:
    """The batch shell's exit code, its stderr and the log, after ``sent`` reached it while the
    command ran (code 0 unless stopped)."""
    shell = start(tmp_path, code=0, **extra)
    wait_for_log(tmp_path, "started", shell)
    shell.send_signal(sent)
    _, err = shell.communicate(timeout=30)
    return shell.returncode, err, log(tmp_path)


def continue_hint(tmp_path: Path) -> str:
    folder = f"{tmp_path}/runs/hvdtrain\\ 42"  # printf %q's quoting of the space
    return (f"to continue the run: sbatch [the same options] train.sbatch --config debug output.dir={folder} "
            f"checkpoint.resume={folder}/checkpoints/last.pt")


def test_the_time_limit_signal_reaches_the_command_and_a_75_requeues_the_job(tmp_path):
    code, err, lines = stopped(tmp_path, signal.SIGUSR1)  # as Slurm's --signal=B:USR1@120 does
    assert code == 0, err
    assert lines == ["started", "got USR1", "stop file: USR1", "scontrol requeue 42"]
    assert "at the time-limit signal (SIGUSR1): requeued (restart 1 of at most 20)" in err, err


def test_a_plain_scancel_cancels_and_says_how_to_continue(tmp_path):
    """`scancel JOB`: Slurm signals the batch shell with SIGTERM and shows the job COMPLETING, its
    EndTime the cancel's, before its time limit is up (or with none); a requeue would bring it back
    (Slurm accepts one), so none is asked for."""
    for limit in ("00:15:00", "UNLIMITED"):
        for name in ("log", "log.asked", "log.requeued"):
            (tmp_path / name).unlink(missing_ok=True)
        code, err, lines = stopped(tmp_path, signal.SIGTERM, STATE="COMPLETING", TIME_LIMIT=limit,
                                   END_TIME="2026-11-29T08:01:00")
        assert code == 75, err
        assert lines == ["started", "got USR1", "stop file: TERM"]  # no scontrol requeue
        assert (f"hvdtrain: job 42 cancelled (scancel) after a checkpoint: not requeued, the checkpoint is kept; "
                f"{continue_hint(tmp_path)}") in err, err
    # Cancelled after the time-limit signal came: cancelled all the same.
    (tmp_path / "log").unlink()
    code, err, lines = stopped(tmp_path, signal.SIGUSR1, STATE="COMPLETING", END_TIME="2026-11-29T08:01:00")
    assert code == 75 and "cancelled (scancel)" in err and "scontrol requeue 42" not in lines, (err, lines)


def test_a_term_that_slurm_does_not_explain_stops_without_a_requeue(tmp_path):
    """`scancel --batch --signal=TERM` (or a kill): the job runs on as far as Slurm says, nothing asked
    for a requeue."""
    code, err, lines = stopped(tmp_path, signal.SIGTERM)
    assert code == 75, err
    assert lines == ["started", "got USR1", "stop file: TERM"]
    assert ("hvdtrain: job 42 stopped after a checkpoint (exit 75) by SIGTERM, which asks for no requeue (the "
            "time-limit signal SIGUSR1, a preemption or `scontrol requeue` do): not requeued; "
            f"{continue_hint(tmp_path)}") in err, err


def test_a_preemption_and_the_time_limit_requeue(tmp_path):
    # A preemption with a grace time: Slurm sends SIGTERM and shows PreemptTime, and requeues the
    # job only when the grace time is over (or cancels it, PreemptMode=CANCEL): requeued now.
    code, err, lines = stopped(tmp_path, signal.SIGTERM, PREEMPT_TIME="2026-11-29T08:01:02")
    assert code == 0 and lines[-1] == "scontrol requeue 42", (err, lines)
    assert "at a preemption: requeued (restart 1 of at most 20)" in err, err
    for name in ("log", "log.asked", "log.requeued"):
        (tmp_path / name).unlink(missing_ok=True)
    # The limit itself (no lead signal, or too short a one): ending at StartTime + TimeLimit.
    code, err, lines = stopped(tmp_path, signal.SIGTERM, STATE="COMPLETING", TIME_LIMIT="1-00:15:00",
                               END_TIME="2026-11-30T08:15:00")
    assert code == 0 and lines[-1] == "scontrol requeue 42", (err, lines)
    assert "at the time limit: requeued (restart 1 of at most 20)" in err, err


def test_a_repeated_stop_signal_is_absorbed(tmp_path):
    shell = start(tmp_path, code=0)
    wait_for_log(tmp_path, "started", shell)
    shell.send_signal(signal.SIGUSR1)  # twice within 100 ms: the helper step's and Slurm's, say
    shell.send_signal(signal.SIGUSR1)
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert log(tmp_path) == ["started", "got USR1", "stop file: USR1", "scontrol requeue 42"]
    assert err.count("stop signal (SIGUSR1) received") == 1, err


def test_a_stop_while_the_ranks_start_reaches_them_through_the_stop_file_alone(tmp_path):
    """srun hands a signal to every rank at once, and one still starting would end on SIGUSR1: in
    the ranks' first minute (forward_after), before rank 0 has set up its run folder, the stop file
    alone tells them."""
    shell = start(tmp_path, code=0, forward_after=60, READ_STOP_FILE="1", NO_RUN_DIR="1")
    wait_for_log(tmp_path, "started", shell)
    shell.send_signal(signal.SIGUSR1)
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert log(tmp_path) == ["started", "read the stop file", "stop file: USR1", "scontrol requeue 42"]
    said = re.search(r"stop signal \(SIGUSR1\) received while the ranks start \(no run folder yet, (\d+) s after "
                     r"srun\): they read it from the stop file", err)
    assert said and int(said.group(1)) < 60, err


def test_a_stop_once_the_ranks_train_is_passed_to_them_within_their_first_minute(tmp_path):
    """Ranks that started in seconds train long before forward_after is up: once rank 0 has set up
    its run folder (every rank has joined, its handler set), the signal goes to them at once, and
    the line does not say they are starting."""
    shell = start(tmp_path, code=0, forward_after=60)
    wait_for_log(tmp_path, "started", shell)
    shell.send_signal(signal.SIGUSR1)
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert log(tmp_path) == ["started", "got USR1", "stop file: USR1", "scontrol requeue 42"]
    assert "stop signal (SIGUSR1) received, passed to the ranks as SIGUSR1" in err, err
    assert "while the ranks start" not in err, err


# srun standing in: ranks that stop after a checkpoint on SIGTERM or SIGUSR1, each rank's own line,
# then srun's line per node on their exit codes (75 here, 2 for a rank that failed with QUIET_CODE).
SRUN = """trap 'stop=1' TERM USR1; stop=0; echo started >> "$LOG"
while ((stop == 0)); do sleep 0.1 & wait $! || true; done
sleep 0.3 & wait $!  # the ranks' checkpoint
echo "rank 0: stopped by SIGTERM; checkpoint saved to run/checkpoints/last.pt" >&2
echo "srun: error: node7: tasks 0-1: Exited with exit code 75" >&2
echo "srun: error: node8: task 3: Exited with exit code ${QUIET_CODE:-75}" >&2
echo "rank 0: its last word" >&2
exit 75"""


def test_srun_s_line_on_a_checkpointed_stop_is_left_out_and_nothing_else(tmp_path):
    """`scancel` as Slurm does it: SIGTERM to every process of the job, the filter included, which
    must neither die (srun would kill its ranks on a broken stderr) nor hold back a rank's lines:
    they come before the script's closing line. srun's "Exited with exit code 75" alone is left
    out; a rank's other exit code is kept."""
    for quiet_code in ("75", "2"):
        (tmp_path / "log").unlink(missing_ok=True)
        shell = start(tmp_path, code=0, command_text=SRUN, quiet_stops=True, QUIET_CODE=quiet_code)
        wait_for_log(tmp_path, "started", shell)
        os.killpg(shell.pid, signal.SIGTERM)
        _, err = shell.communicate(timeout=30)
        assert shell.returncode == 75, err
        lines = err.splitlines()
        closing = next(i for i, line in enumerate(lines) if "stopped after a checkpoint (exit 75)" in line)
        assert lines.index("rank 0: its last word") < closing, err
        assert "rank 0: stopped by SIGTERM; checkpoint saved to run/checkpoints/last.pt" in lines, err
        assert "srun: error: node7: tasks 0-1: Exited with exit code 75" not in err, err
        kept = "srun: error: node8: task 3: Exited with exit code 2"
        assert (kept in lines) == (quiet_code == "2"), err
        assert "Exited with exit code 75" not in err, err
    # Without quiet_stops (the horovodrun script's launcher prints no such line): all of it.
    (tmp_path / "log").unlink()
    shell = start(tmp_path, code=0, command_text=SRUN)
    wait_for_log(tmp_path, "started", shell)
    shell.send_signal(signal.SIGTERM)
    _, err = shell.communicate(timeout=30)
    assert "srun: error: node7: tasks 0-1: Exited with exit code 75" in err, err


def test_a_stop_before_the_ranks_start_requeues_with_nothing_started(tmp_path):
    shell = start(tmp_path, code=0, early=True)
    wait_for_log(tmp_path, "waiting", shell)
    shell.send_signal(signal.SIGUSR1)
    shell.send_signal(signal.SIGUSR1)
    (tmp_path / "go").touch()
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert log(tmp_path) == ["waiting", "scontrol requeue 42"]  # the command never started
    assert "stop signal (SIGUSR1) received before the ranks started: nothing to checkpoint, ending with 75" in err
    assert "requeued (restart 1 of at most 20)" in err


def test_requeued_is_said_when_slurm_has_the_job_requeued_and_only_then(tmp_path):
    # scontrol requeue from outside (or a preemption, a node failure with requeue): Slurm counts the
    # restart at once (the job shows COMPLETING until this attempt ends, then PENDING), and requeuing
    # it again would fail.
    shell = start(tmp_path, code=75, ticks=1, STATE="COMPLETING", SHOWN_RESTARTS="1")
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0, err
    assert "requeued already by Slurm (restart 1); it resumes from the checkpoint" in err
    assert "could not be requeued" not in err and "to continue the run" not in err
    assert not any(line.startswith("scontrol requeue") for line in log(tmp_path))
    # And at the cap: Slurm has it anyway.
    shell = start(tmp_path, code=75, ticks=1, restarts=3, most=3, STATE="COMPLETING", SHOWN_RESTARTS="4")
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 0 and "requeued already by Slurm (restart 4)" in err, err
    # A requeue Slurm refuses (#SBATCH --no-requeue): said, with the way to continue.
    (tmp_path / "log").unlink()
    shell = start(tmp_path, code=75, ticks=1, REQUEUE_FAILS="scontrol: error: Requeue of job 42 not allowed",
                  STATE="TIMEOUT")
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 75
    assert ("at the time limit and could not be requeued (scontrol: error: Requeue of job 42 not allowed: a "
            f"cancelled job, or #SBATCH --no-requeue); {continue_hint(tmp_path)}") in err, err
    assert "requeued already" not in err


def test_a_slurmctld_too_busy_to_answer_gives_no_false_word(tmp_path):
    # Requeued from outside while slurmctld is too busy to show the job: the script's own requeue
    # (for the time-limit signal) fails as Slurm's does for a job requeued already, and the next
    # look shows the restart.
    code, err, _ = stopped(tmp_path, signal.SIGUSR1, SHOW_SILENT="until-requeue", SHOWN_RESTARTS="1",
                           REQUEUE_FAILS="Job is pending execution for job 42")
    assert code == 0, err
    assert "requeued already by Slurm (restart 1); it resumes from the checkpoint" in err, err
    assert "could not be requeued" not in err and "to continue the run" not in err, err
    # No answer at all: neither "requeued" nor "could not be requeued", and the way to find out.
    for name in ("log", "log.asked"):
        (tmp_path / name).unlink(missing_ok=True)
    code, err, _ = stopped(tmp_path, signal.SIGUSR1, SHOW_SILENT="always")
    assert code == 75, err
    assert ("at the time-limit signal (SIGUSR1); Slurm did not answer whether it is requeued (scontrol requeue: "
            "asked): see Restarts= in `scontrol show job 42`; if it is not, to continue the run") in err, err
    assert "requeued (restart" not in err and "could not be requeued" not in err, err
    # A SIGTERM Slurm does not explain: a cancel is as likely as a preemption, and a requeue of a
    # cancelled job would bring it back: none.
    for name in ("log", "log.asked"):
        (tmp_path / name).unlink(missing_ok=True)
    code, err, lines = stopped(tmp_path, signal.SIGTERM, SHOW_SILENT="always")
    assert code == 75 and not any(line.startswith("scontrol") for line in lines), (err, lines)
    assert "Slurm did not answer what stopped it (a cancel, a preemption?): not requeued; see `scontrol" in err, err


def test_other_codes_are_not_requeued_and_are_the_jobs_own(tmp_path):
    for code in (0, 1, 2, 74):
        (tmp_path / "log").unlink(missing_ok=True)
        shell = start(tmp_path, code=code, ticks=1)  # no signal comes: end at once
        shell.communicate(timeout=30)
        assert shell.returncode == code
        assert not any(line.startswith("scontrol") for line in log(tmp_path)), (code, log(tmp_path))


def test_the_requeues_are_capped(tmp_path):
    shell = start(tmp_path, code=75, restarts=3, most=3, ticks=1, STATE="TIMEOUT")
    _, err = shell.communicate(timeout=30)
    assert shell.returncode == 75
    assert not any(line.startswith("scontrol") for line in log(tmp_path))
    assert ("at the time limit and was requeued 3 times already (HVDTRAIN_MAX_REQUEUES=3): not requeued again; "
            "to continue the run") in err, err


def master(tmp_path: Path, job: str, **extra: str) -> list[str]:
    """MASTER_ADDR and MASTER_PORT as export_master leaves them for job ``job``."""
    scontrol = tmp_path / "scontrol"
    scontrol.write_text(SCONTROL)
    scontrol.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if not key.startswith("MASTER_")}
    env.update({"PATH": f"{tmp_path}:{os.environ['PATH']}", "SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "node[7-8]",
                "PYTHON": sys.executable, "LOG": str(tmp_path / "log"), **extra})
    shown = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{REQUEUE}"; export_master; '
                            'echo "$MASTER_ADDR $MASTER_PORT"'], env=env, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    return shown.stdout.split()


def test_each_job_gets_a_free_port_of_its_own(tmp_path):
    """dist.engine=torch's rendezvous: rank 0's host, and a port derived from the job id, checked
    free on this node; two jobs whose ids give the same port get two."""
    def bindable(port: int) -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("", port))
            except OSError:
                return False
        return True

    with socket.socket() as held:  # the port job 4242 would get, held by another job
        held.bind(("", 15000 + 4242))
        held.listen()
        taken = master(tmp_path, "4242")
        expected = next(port for port in range(15000 + 4243, 15000 + 4342) if bindable(port))
        assert taken == ["node7", str(expected)]
        other = master(tmp_path, str(15000 + 4242))  # derives the same port as 4242: also the next free one
        assert other == ["node7", str(expected)] and bindable(expected)
    assert master(tmp_path, "4242") == ["node7", str(15000 + 4242)]  # free again
    assert master(tmp_path, "4242", MASTER_ADDR="head", MASTER_PORT="31000") == ["head", "31000"]  # the user's


def test_each_job_gets_a_secret_of_its_own_in_the_environment(tmp_path):
    """The torch engine admits only ranks that know the job's secret: export_master makes one per
    attempt (64 hex digits), different each time, and keeps a user's own."""
    def secret(**extra: str) -> str:
        env = {key: value for key, value in os.environ.items() if key != "HVDTRAIN_JOB_SECRET"}
        env.update({"SLURM_JOB_ID": "4242", "MASTER_ADDR": "head", "MASTER_PORT": "31000", "PYTHON": sys.executable,
                    **extra})
        shown = subprocess.run(["bash", "-c", f'set -euo pipefail; source "{REQUEUE}"; export_master; '
                                'printenv HVDTRAIN_JOB_SECRET'], env=env, capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        return shown.stdout.strip()

    first, second = secret(), secret()
    assert re.fullmatch(r"[0-9a-f]{64}", first) and first != second
    own = "the-users-own-secret-of-32-characters"
    assert secret(HVDTRAIN_JOB_SECRET=own) == own


def test_attempt_records_name_the_job_and_the_exit():
    from hvdtrain.config import ConfigError
    from hvdtrain.train.stops import Preempted

    assert exit_of(None) == (0, "finished")
    assert exit_of(Preempted("stopped by SIGTERM in epoch 2/3")) == (75, "stopped by SIGTERM in epoch 2/3")
    assert exit_of(ConfigError("config key 'x': unknown")) == (2, "config key 'x': unknown")
    assert exit_of(RuntimeError("boom\nmore")) == (1, "RuntimeError: boom")
    saved = {k: os.environ.pop(k) for k in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "PBS_JOBID", "LSB_JOBID", "JOB_ID")
             if k in os.environ}
    try:
        assert job_identity() == {"job": None, "restart": None}
        os.environ.update(SLURM_JOB_ID="7", SLURM_RESTART_COUNT="2")
        assert job_identity() == {"job": "7", "restart": 2}
    finally:
        for key in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT"):
            os.environ.pop(key, None)
        os.environ.update(saved)


def test_a_stop_signal_during_start_up_is_kept_for_the_first_step():
    """Slurm's signal ahead of the time limit may come while the ranks still build their loaders: it
    must not end them (SIGUSR1's default action does), but stop the run at its first step."""
    from hvdtrain.fault.preemption import StopRequest

    before = signal.getsignal(signal.SIGUSR1)
    stop = StopRequest()
    stop.keep_early()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        assert stop.received == signal.SIGUSR1 and stop.reason() == "SIGUSR1"
    finally:
        stop.release_early()
    assert signal.getsignal(signal.SIGUSR1) is before


def attempt_records(*ends: tuple[int, int]) -> list[dict]:
    """attempts.jsonl of attempts that each started and ended at the given global steps (exit 75),
    then the start of the attempt in progress at the last end's step."""
    records = []
    for start_step, end_step in ends:
        records.append({"event": "start", "step": start_step})
        records.append({"event": "end", "step": end_step, "exit": 75, "startup_seconds": 40.0,
                        **({"step_seconds": 0.5} if end_step > start_step else {})})
    records.append({"event": "start", "step": ends[-1][1]})
    return records


def test_a_time_limit_too_short_for_a_step_stops_the_requeues_in_one_line():
    from hvdtrain.fault.attempts import no_progress_line, slurm_seconds

    # The first attempt trained to step 11; the next trained nothing: that alone may be a preemption
    # in its start-up, unless the stop came at the time limit.
    assert no_progress_line(attempt_records((0, 11)), 11, 47.0, None) is None
    assert no_progress_line(attempt_records((0, 11)), 11, 47.0, (24 * 3600.0, 3600.0)) is None
    line = no_progress_line(attempt_records((0, 11)), 11, 47.0, (180.0, 60.0))
    assert line == ("this attempt stopped at global step 11 without training a step (the one before it trained 11 "
                    "steps): start-up takes about 47 s "
                    "and a step 0.5 s, so a requeue would do the same again; not requeued (exit 2): the stop "
                    "signal came 60 s into a time limit of 3 min; submit it again with --time=13 or more "
                    "(start-up, the signal's lead of about 120 s and 10 min of steps)")
    # Two attempts in a row without a step: whatever sent the signal.
    line = no_progress_line(attempt_records((0, 11), (11, 11)), 11, 45.0, None)
    assert line.startswith("attempts stopped twice at global step 11 without training a step: start-up takes "
                           "about 45 s and a step 0.5 s")
    assert line.endswith("give each attempt at least 11 min before its stop signal (start-up and 10 min of steps), "
                         "or find what stops it this early")
    assert no_progress_line(attempt_records((0, 11), (11, 11)), 11, 45.0, (900.0, 40.0)) == line  # not the limit's
    assert no_progress_line(attempt_records((0, 11), (11, 12)), 12, 45.0, None) is None  # it made progress
    # One step before, then none at the limit: "twice" would be false, and so would "step 0".
    line = no_progress_line(attempt_records((0, 1)), 1, 47.0, (180.0, 60.0))
    assert line.startswith("this attempt stopped at global step 1 without training a step (the one before it "
                           "trained 1 step): start-up takes about 47 s and a step 0.5 s"), line
    assert [slurm_seconds(t) for t in ("00:03:00", "1-00:00:10", "05:00", "UNLIMITED")] == [180.0, 86410.0, 300.0,
                                                                                              None]
