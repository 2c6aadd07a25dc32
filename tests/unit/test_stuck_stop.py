"""A rank stuck in Python, where no step boundary comes (a loop in data code before its first step),
still obeys a stop signal: the watchdog's thread ends it within dist.timeout_seconds of the signal,
with one line naming where it was stuck and exit code 75; work that is progress without steps
(validation batches, a checkpoint being written) is not cut short."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# A rank as the trainer sets it up: the stop handler installed, the watchdog told about it (not armed:
# no step completed yet), then stuck in a loop that never checks anything, as pax_path once was.
STUCK = """
import sys, time
from hvdtrain.fault.preemption import StopRequest
from hvdtrain.fault.watchdog import Watchdog

stop = StopRequest()
watchdog = Watchdog(float(sys.argv[1]), [], 0)
watchdog.stop_pending = stop.pending_since
mode = sys.argv[2]

def spin_in_data_code(data):
    at = 0
    while at < len(data):
        at += 0

with stop.installed():
    print("ready", flush=True)
    if mode == "busy":
        with watchdog.busy():  # a checkpoint being written: the stop waits for it
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline:
                pass
        print("saved", flush=True)
    if mode == "progress":
        for _ in range(30):  # validation batches: progress, not steps
            time.sleep(0.1)
            watchdog.progress()
        print("validated", flush=True)
    spin_in_data_code(b"0 foo=bar\\n")
"""


def start(timeout: float, mode: str) -> subprocess.Popen:
    child = subprocess.Popen([sys.executable, "-c", STUCK, str(timeout), mode], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline() == "ready\n"
    return child


def test_a_rank_stuck_in_data_code_ends_after_a_sigterm_with_one_line_and_75():
    child = start(1.0, "stuck")
    try:
        os.kill(child.pid, signal.SIGTERM)
        sent = time.monotonic()
        code = child.wait(timeout=30)  # the old code ignored SIGTERM here for ever
        took = time.monotonic() - sent
        err = child.stderr.read()
    finally:
        child.kill()
    assert code == 75, err
    lines = err.splitlines()
    assert len(lines) == 1 and re.match(r"hvdtrain: stop signal received \d+ s ago, but rank 0 has made no progress "
                                        r"for 1 s \(dist.timeout_seconds\): it is stuck in <string>:\d+ "
                                        r"\(spin_in_data_code\)\. Ending it without a checkpoint", lines[0]), lines
    assert 1.0 <= took < 10, took


@pytest.mark.parametrize("mode, said", [("busy", "saved"), ("progress", "validated")])
def test_a_checkpoint_or_validation_in_progress_is_not_cut_short(mode, said):
    child = start(1.0, mode)
    try:
        os.kill(child.pid, signal.SIGTERM)
        assert child.stdout.readline() == f"{said}\n"  # 3 s of it, past the 1 s timeout
        code = child.wait(timeout=30)  # then stuck: ended
    finally:
        child.kill()
    assert code == 75


def test_without_a_stop_signal_or_without_a_watchdog_nothing_ends_it():
    for timeout in (1.0, 0.0):
        child = start(timeout, "stuck")
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                child.wait(timeout=2.5)  # not armed, no signal: the first step is not timed
        finally:
            child.kill()
            child.wait()
