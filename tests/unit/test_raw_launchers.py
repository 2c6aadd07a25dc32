"""How a job ends under the raw launchers, torchrun and horovodrun, which turn any exit code but 0
into their own 1 and a traceback, and end the other ranks with SIGTERM when one exits.

A stop after a checkpoint reads as a stop: every rank exits 0 and rank 0's last line says it stopped
and how to resume; where the code reaches the caller (hvdtrain launch, hvdtrain ray, mpirun, srun,
one process) it stays 75. An error every rank hits alike is one line from rank 0: another rank that
the launcher ends while it waits leaves at once, quiet, with the same code. In process: the
launchers' variables and signals are set by hand (tests/parallel/test_raw_launchers.py launches for
real)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from hvdtrain import cli, outcome
from hvdtrain.comm import launcher_env
from hvdtrain.config import ConfigError
from hvdtrain.launch.records import LAUNCHER_VARIABLE
from hvdtrain.train.stops import NoProgress, PeerLost, Preempted

STOP = "stopped by SIGTERM in epoch 2/5 at step 3/22 (global step 25); checkpoint saved to runs/x/last.pt"
LAST_LINE = ("hvdtrain: stopped after a checkpoint: run the same command to resume (exit 0: {} would report exit 75 "
             "as a failure, with a traceback; hvdtrain launch and srun exit 75)\n")
TORCHRUN = {"TORCHELASTIC_RUN_ID": "none", "RANK": "0", "WORLD_SIZE": "2"}
HOROVODRUN = {"HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}


@pytest.fixture(autouse=True)
def no_launcher(monkeypatch):
    for name in (launcher_env.RANK_VARIABLES + launcher_env.SIZE_VARIABLES
                 + ("TORCHELASTIC_RUN_ID", "HOROVOD_GLOO_RENDEZVOUS_ADDR", LAUNCHER_VARIABLE)):
        monkeypatch.delenv(name, raising=False)


def under(monkeypatch, env: dict[str, str]) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("env, name", [(TORCHRUN, "torchrun"), (HOROVODRUN, "horovodrun")])
def test_under_torchrun_and_horovodrun_a_stop_exits_0_with_rank_0s_last_line(env, name, monkeypatch, capsys):
    under(monkeypatch, env)
    assert outcome.stop_code(Preempted(STOP)) == 0
    assert capsys.readouterr() == (LAST_LINE.format(name), "")
    assert outcome.cause() == STOP  # what the run's own records keep


@pytest.mark.parametrize("env", [TORCHRUN, HOROVODRUN])
def test_the_other_ranks_exit_0_quietly(env, monkeypatch, capsys):
    under(monkeypatch, {**env, "RANK": "1", "HOROVOD_RANK": "1"})
    assert outcome.stop_code(Preempted(STOP)) == 0
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize("env", [
    {},  # one process
    {**HOROVODRUN, LAUNCHER_VARIABLE: "launch"},  # hvdtrain launch: returns 75 with its own last line
    {**HOROVODRUN, LAUNCHER_VARIABLE: "ray"},  # hvdtrain ray reads the ranks' codes
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"},  # mpirun
    {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"},  # srun
])
def test_where_the_code_reaches_the_caller_it_stays_75(env, monkeypatch, capsys):
    under(monkeypatch, env)
    assert outcome.stop_code(Preempted(STOP)) == 75
    assert capsys.readouterr() == ("", "")


def test_only_a_resumable_stop_exits_0(monkeypatch, capsys):
    """A stop that a rerun would not get past (no progress: 2) or a lost peer (75, but the job is
    broken, and the launcher reports the lost rank anyway) keeps its code."""
    under(monkeypatch, TORCHRUN)
    assert outcome.stop_code(NoProgress("no step trained in this attempt")) == 2
    assert outcome.stop_code(PeerLost("rank 1 (node1) stopped answering", False)) == 75
    assert capsys.readouterr().out == ""


def test_hvdtrains_launchers_mark_their_ranks(monkeypatch, tmp_path, capsys):
    from hvdtrain.launch import horovodrun
    from hvdtrain.launch.ray_plan import Slot, rank_env

    slot = Slot(actor=0, rank=0, local_rank=0, cross_rank=0, size=1, local_size=1, cross_size=1, host="a")
    assert rank_env(slot, "", "127.0.0.1", 1, [])[LAUNCHER_VARIABLE] == "ray"
    given = {}

    def popen(argv, env, **kwargs):  # the environment hvdtrain launch gives horovodrun, then no start
        given.update(env)
        raise OSError("not started")

    monkeypatch.setattr(horovodrun.subprocess, "Popen", popen)
    assert horovodrun.launch(["-np", "1", "python", "-c", "pass"], "ab" * 16, tmp_path) == 2
    assert given[LAUNCHER_VARIABLE] == "launch"


def test_the_train_command_exits_0_under_torchrun(monkeypatch, capsys):
    """python -m hvdtrain under torchrun: the stop's code is the process's, and its last line rank 0's."""
    import hvdtrain.api

    def stopped(cfg):
        print(f"hvdtrain: {STOP}", flush=True)  # the loop's own stop line (train/outputs.py)
        raise Preempted(STOP)

    monkeypatch.setattr(hvdtrain.api, "run_training", stopped)
    under(monkeypatch, TORCHRUN)
    assert cli.main(["--config", "debug", "data.synthetic=true", "dist.engine=torch"]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[-2:] == [f"hvdtrain: {STOP}", LAST_LINE.format("torchrun").rstrip("\n")]
    assert err == ""


def test_fit_ends_the_script_with_0_under_horovodrun(monkeypatch, capsys):
    import hvdtrain.api

    def stopped(cfg):
        raise Preempted(STOP)

    monkeypatch.setattr(hvdtrain.api, "run_training", stopped)
    under(monkeypatch, HOROVODRUN)
    with pytest.raises(SystemExit) as ended:
        hvdtrain.api.fit(config={"data.synthetic": True, "train.epochs": 1, "model.arch": "resnet18"})
    assert ended.value.code == 0
    assert capsys.readouterr().out.endswith(LAST_LINE.format("horovodrun"))


# --- an error every rank hits alike -----------------------------------------------------------------

@pytest.fixture
def caught_sigterm():
    """SIGTERM recorded instead of ending pytest, as python -m hvdtrain catches it (fault/signals.py)."""
    got: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    yield got
    signal.signal(signal.SIGTERM, before)


@pytest.mark.parametrize("env", [TORCHRUN, HOROVODRUN])
def test_a_rank_the_launcher_ends_while_it_waits_leaves_at_once_quiet_with_the_same_code(env, monkeypatch, capsys,
                                                                                          caught_sigterm):
    under(monkeypatch, {**env, "RANK": "1", "HOROVOD_RANK": "1"})
    handler = signal.getsignal(signal.SIGTERM)
    # Rank 0 said why and exited 2; the launcher now ends this rank, 0.3 s into its 10 s wait.
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    assert outcome.report_error(ConfigError("config key 'train.epochs' expects int, got 'abc'")) == 2
    assert time.monotonic() - started < 3
    assert capsys.readouterr() == ("", "")
    assert signal.getsignal(signal.SIGTERM) is handler and caught_sigterm == []  # the process's own handler back


def test_a_rank_that_alone_failed_says_so_after_the_wait(monkeypatch, capsys, caught_sigterm):
    under(monkeypatch, {**TORCHRUN, "RANK": "1"})
    monkeypatch.setattr(outcome, "PEER_PAUSE_SECONDS", 0.2)
    assert outcome.report_error(ConfigError("data.dir=/x does not exist on this host")) == 2
    assert capsys.readouterr() == ("", f"hvdtrain: error on rank 1 ({socket.gethostname()}): data.dir=/x does not "
                                       "exist on this host\n")


def test_rank_0_says_it_at_once(monkeypatch, capsys):
    under(monkeypatch, TORCHRUN)
    monkeypatch.setattr(outcome, "PEER_PAUSE_SECONDS", 60)
    started = time.monotonic()
    assert outcome.report_error(ConfigError("config key 'train.epochs' expects int, got 'abc'")) == 2
    assert time.monotonic() - started < 1
    assert capsys.readouterr().err == "hvdtrain: error: config key 'train.epochs' expects int, got 'abc'\n"
