"""The torch engine's store keeps out a process that is not one of the job's ranks, run as a second
Unix user where the suite can make one (tests/users.py), else as this one (the protocol is the
same; only the name in the line differs). The attacker (tests/parallel/store_intruder.py) knows
everything but HVDTRAIN_JOB_SECRET, and sends a pickle that would create a marker file in a folder
only the victim can write.

- It joins a waiting job's store as "rank 1": rank 0 refuses it in one line that names its
  address and user, and stops (exit 2); the marker does not exist.
- It listens first on the job's MASTER_PORT: rank 0 says in one line that the port is in use;
  rank 1 finds that the store is not the job's, names who listens there, and stops in one line
  without acting on anything the store holds; the marker does not exist.
- Rank 0's store listens on MASTER_ADDR's address alone (127.0.0.1), not every interface.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import users
from tests.helpers import BIN, REPO, free_port, job_env, tiny

INTRUDER = REPO / "tests" / "parallel" / "store_intruder.py"
WAIT_SECONDS = 120
SECRET = "f" * 64  # the job's, shared by its ranks alone


def listening(port: int) -> list[str]:
    """The addresses that listen on ``port`` on this host (/proc/net/tcp, state 0A), as hex."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as lines:
            for row in (line.split() for line in list(lines)[1:]):
                if row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:
                    found.append(row[1].rsplit(":", 1)[0])
    return found


def wait_listening(port: int, process: subprocess.Popen) -> list[str]:
    deadline = time.monotonic() + WAIT_SECONDS
    while not listening(port):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"nothing listens on {port}"
        time.sleep(0.05)
    return listening(port)


def attacker() -> str | None:
    """The second user's name, or None where the suite cannot make one (the attacker is this user)."""
    return None if users.why_not() else users.user().pw_name


def start_intruder(mode: str, port: int, marker: Path, scratch: Path) -> subprocess.Popen:
    command = [str(BIN / "python"), str(INTRUDER), mode, str(port), str(marker)]
    if attacker():  # it becomes the second user before it opens a socket (the interpreter may be root's alone)
        command += [str(users.user().pw_uid), str(users.user().pw_gid)]
    env = {"PATH": os.environ["PATH"], "HOME": str(scratch), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, cwd=scratch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def start_rank(rank: int, port: int, tiny_data: Path, tmp_path: Path) -> subprocess.Popen:
    env = {**job_env(tmp_path), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    env["HVDTRAIN_JOB_SECRET"] = SECRET
    command = [str(BIN / "python"), "-m", "hvdtrain"] + tiny(tiny_data, tmp_path / "run", "dist.engine=torch")
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def stop(process: subprocess.Popen) -> str:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    return process.communicate()[0] or ""


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


@pytest.fixture
def scratch():
    folder = users.scratch()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_process_joining_as_rank_1_is_refused_named_and_runs_nothing(tiny_data, tmp_path, scratch):
    port, marker = free_port(), tmp_path / "code-ran"
    rank0 = start_rank(0, port, tiny_data, tmp_path)
    intruder = None
    try:
        assert wait_listening(port, rank0) == ["0100007F"]  # 127.0.0.1 alone, not 0.0.0.0
        intruder = start_intruder("rank1", port, marker, scratch)
        stdout, stderr = rank0.communicate(timeout=WAIT_SECONDS)
    finally:
        said = stop(intruder) if intruder else ""
        stop(rank0)
    lines = error_lines(stderr)
    assert rank0.returncode == 2 and len(lines) == 1, (rank0.returncode, stderr[-3000:], said)
    line = lines[0]
    assert line.startswith("hvdtrain: error: a process that is not one of this job's ranks joined the store at "
                           f"127.0.0.1:{port} as rank 1 and could not prove the job's secret"), line
    if attacker():
        assert f"(user {attacker()}, uid {users.user().pw_uid})" in line, line
    assert not marker.exists()
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.pt"))


def test_an_impostor_listening_first_on_the_port_is_found_out_before_anything_is_used(tiny_data, tmp_path, scratch):
    port, marker = free_port(), tmp_path / "code-ran"
    impostor = start_intruder("impostor", port, marker, scratch)
    ranks = []
    try:
        wait_listening(port, impostor)
        ranks = [start_rank(rank, port, tiny_data, tmp_path) for rank in (0, 1)]
        results = [rank.communicate(timeout=WAIT_SECONDS) for rank in ranks]
    finally:
        said = stop(impostor)
        for rank in ranks:
            stop(rank)
    (_, err0), (_, err1) = results
    lines0, lines1 = error_lines(err0), error_lines(err1)
    assert [rank.returncode for rank in ranks] == [2, 2], (err0[-2000:], err1[-2000:], said)
    assert lines0 == [f"hvdtrain: error: MASTER_PORT={port} is in use on 127.0.0.1 (another job, or another process, "
                      "listens there): export a free port as MASTER_PORT (or torchrun --master_port), one per job on "
                      "a shared host"], err0
    assert len(lines1) == 1 and lines1[0].startswith("hvdtrain: error on rank 1 "), err1
    assert f"the store at 127.0.0.1:{port} is not this job's (it could not prove the job's secret)" in lines1[0]
    if attacker():
        assert f"(user {attacker()}, uid {users.user().pw_uid})" in lines1[0], lines1[0]
    assert not marker.exists()
