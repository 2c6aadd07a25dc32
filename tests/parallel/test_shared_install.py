"""A shared install made by root, used by another user.

Root makes a venv from a Python every user can read (/usr/bin/python3) and installs hvdtrain into
it as setup.sh does for a shared install (scripts/shared-install.sh: a copy, not editable, the
Slurm scripts under share/), Horovod from setup's wheel cache. Then a user made here with useradd,
whose HOME does not exist, runs from a folder of their own:

- a 2-rank job through ``hvdtrain launch`` (horovodrun, Gloo): it trains, and its output goes to
  the job's own folder under theirs (``runs/<job name>-<job id>``, a Slurm job id in the
  environment), owned by them;
- the shipped batch script from the install's share/ folder, as Slurm runs it (a copy in a spool
  folder, ``scontrol show job`` naming the original): it finds the install and trains in their folder.

Speed: torch and the other pinned packages (5 GB) come from this checkout's venv through a .pth
file instead of a second download and install; hvdtrain and Horovod are installed for real.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import BIN, JOB_TIMEOUT, REPO

USER = "hvdtrain-alice"
HOME = f"/nonexistent/{USER}"
SYSTEM_PYTHON = Path("/usr/bin/python3")
MAIN_SITE = Path(sysconfig.get_paths()["purelib"])  # this venv's site-packages: torch, numpy, ...
WHEELS = REPO / ".cache" / "setup" / "wheels"


def readable_by_others(path: Path) -> bool:
    steps = [path, *path.parents]
    return all(step.stat().st_mode & stat.S_IXOTH for step in steps if step.is_dir())


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root (useradd, and an install made by root)"
    if not shutil.which("useradd"):
        return "needs useradd"
    check = subprocess.run(["bash", str(REPO / "scripts" / "shared-install.sh"), "python-check", str(SYSTEM_PYTHON)],
                           capture_output=True, text=True)
    if not SYSTEM_PYTHON.exists() or check.returncode != 0:
        return f"needs {SYSTEM_PYTHON}, readable by every user"
    version = subprocess.run([str(SYSTEM_PYTHON), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != str(sys.version_info[:2]):
        return f"{SYSTEM_PYTHON} is Python {version}, this venv's packages are for {sys.version_info[:2]}"
    if not readable_by_others(MAIN_SITE):
        return f"this venv's packages ({MAIN_SITE}) are not readable by other users"
    if not list(WHEELS.glob("*/horovod-*.whl")):
        return f"no Horovod wheel in setup's cache ({WHEELS}): run make setup"
    return None


pytestmark = pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))


@pytest.fixture(scope="module")
def alice():
    """(uid, gid) of a user who is not root and has no home."""
    created = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", HOME, "--shell", "/bin/sh", USER],
                       check=True, capture_output=True)
        created = True
    entry = pwd.getpwnam(USER)
    try:
        yield entry.pw_uid, entry.pw_gid
    finally:
        end_processes_of(entry.pw_uid)  # a job that timed out leaves its ranks behind
        if created:
            subprocess.run(["userdel", USER], capture_output=True)


def end_processes_of(uid: int) -> None:
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                os.kill(int(entry.name), 9)
        except OSError:
            continue


@pytest.fixture(scope="module")
def shared(alice):
    """(root of the test's folders, the venv): an install made by root, readable by everyone."""
    root = Path(tempfile.mkdtemp(prefix="hvdtrain-shared-", dir="/tmp"))
    os.chmod(root, 0o755)
    venv = root / "opt" / "hvdtrain"
    started = time.monotonic()
    try:
        subprocess.run([str(SYSTEM_PYTHON), "-m", "venv", "--without-pip", str(venv)], check=True)
        site = Path(subprocess.run([str(venv / "bin" / "python"), "-c",
                                    "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                   check=True, capture_output=True, text=True).stdout.strip())
        # After the venv's own site-packages: hvdtrain and Horovod below are the venv's own.
        (site / "zz_hvdtrain_test_packages.pth").write_text(f"{MAIN_SITE}\n")
        env = {**os.environ, "PIP_CONFIG_FILE": "/dev/null", "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        env.pop("PIP_FIND_LINKS", None)
        env.pop("PYTHONPATH", None)
        wheel = sorted(WHEELS.glob("*/horovod-*.whl"))[0]
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed",
                        str(wheel)], check=True, env=env, cwd=root)
        subprocess.run(["bash", str(REPO / "scripts" / "shared-install.sh"), "install", str(venv / "bin" / "python"),
                        "copy"], check=True, env=env, cwd=root)
        print(f"shared install made in {time.monotonic() - started:.1f} s")
        yield root, venv
    finally:
        shutil.rmtree(root, ignore_errors=True)


def user_folder(root: Path, alice: tuple[int, int], name: str) -> Path:
    folder = root / name
    folder.mkdir()
    os.chown(folder, *alice)
    os.chmod(folder, 0o700)
    return folder


def as_user(alice: tuple[int, int], command: list[str], cwd: Path, env: dict[str, str],
            timeout: float = JOB_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, env=env, user=alice[0], group=alice[1], extra_groups=[],
                          capture_output=True, text=True, timeout=timeout)


def user_env(venv: Path, extra_path: str = "", **more: str) -> dict[str, str]:
    """What a login on a cluster gives: no PYTHONPATH to this checkout, a HOME they cannot write."""
    return {"PATH": f"{extra_path}{venv / 'bin'}:/usr/local/bin:/usr/bin:/bin", "HOME": HOME, "USER": USER,
            "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
            "OMPI_MCA_btl_vader_single_copy_mechanism": "none", **more}


# output.dir=auto: the debug config names its own folder
TRAIN = ["--config", "debug", "output.dir=auto", "data.synthetic=true", "data.synthetic_samples=64", "train.epochs=2",
         "train.steps_per_epoch=2", "train.batch_size=4", "runtime.stats_interval=0", "output.tensorboard=false"]


def train_records(run_dir: Path) -> list[dict]:
    return [record for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if record.get("split") == "train"]


def test_a_user_runs_a_two_rank_job_against_roots_install(shared, alice):
    root, venv = shared
    mine = user_folder(root, alice, "alice-runs")
    python = str(venv / "bin" / "python")
    where = as_user(alice, [python, "-c", "import hvdtrain, horovod.torch; print(hvdtrain.__file__)"], mine,
                    user_env(venv))
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv / "lib")), where.stdout  # the install's copy, not the checkout
    closed = Path(os.path.realpath(BIN / "python"))
    if not readable_by_others(closed.parent):  # what the issue measured: a venv from a private Python
        denied = as_user(alice, ["sh", "-c", '"$0" -c "import hvdtrain"', str(BIN / "python")], mine, user_env(venv))
        assert denied.returncode == 126 and "Permission denied" in denied.stderr
    started = time.monotonic()
    result = as_user(alice, [python, "-m", "hvdtrain", "launch", "-np", "2", "-H", "localhost:2", "--gloo",
                             python, "-m", "hvdtrain", *TRAIN], mine,
                     user_env(venv, SLURM_JOB_ID="4242", SLURM_JOB_NAME="alice-job"))
    print(f"2-rank job as {USER}: {time.monotonic() - started:.1f} s")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert f"hvdtrain launch: HOME ({HOME}) is not writable" in result.stderr
    run_dir = mine / "runs" / "alice-job-4242"
    assert f"hvdtrain: output folder {run_dir}" in output
    records = train_records(run_dir)
    assert [(r["epoch"], r["samples"]) for r in records] == [(0, 16), (1, 16)]  # 2 steps x 2 ranks x 4
    assert all(path.stat().st_uid == alice[0] for path in [run_dir, *run_dir.rglob("*")])


def test_the_installed_batch_script_runs_from_the_users_folder(shared, alice):
    """As Slurm runs it: a copy of the script in a spool folder, started in the submit folder;
    scontrol names the script it was submitted by (the install's share/hvdtrain/slurm)."""
    root, venv = shared
    mine = user_folder(root, alice, "alice-sbatch")
    script = venv / "share" / "hvdtrain" / "slurm" / "train.sbatch"
    assert script.is_file()
    tools = root / "fake-slurm-bin"
    tools.mkdir()
    (tools / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=4243 JobName=hvdtrain'\necho '   Command={script} x'\n")
    (tools / "srun").write_text('#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')  # one rank
    spool = root / "spool"
    spool.mkdir()
    shutil.copy(script, spool / "slurm_script")
    for path in (tools / "scontrol", tools / "srun", spool / "slurm_script"):
        path.chmod(0o755)
    result = as_user(alice, ["bash", str(spool / "slurm_script"), *TRAIN], mine,
                     user_env(venv, f"{tools}:", SLURM_JOB_ID="4243", SLURM_JOB_NAME="hvdtrain", SLURM_NTASKS="1",
                              SLURM_JOB_NUM_NODES="1", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=str(mine)))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    run_dir = mine / "runs" / "hvdtrain-4243"
    assert f"hvdtrain: output folder {run_dir}" in output
    assert [(r["epoch"], r["samples"]) for r in train_records(run_dir)] == [(0, 8), (1, 8)]  # 2 steps x 1 rank x 4
