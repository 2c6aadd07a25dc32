"""A shared install used by people who are not root, the parts that need no
other user: the default output folder per Slurm job, an output folder that cannot be made, HOME
without horovodrun's cache, a Python others cannot read, and the Slurm scripts finding the install
from their own location. tests/parallel/test_shared_install.py runs a job as another user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.job_config import load_config
from hvdtrain.launch import horovodrun as launch
from hvdtrain.train import run_folder

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "hostfiles" / "slurm"
SHARED_INSTALL = REPO / "scripts" / "shared-install.sh"


@pytest.mark.parametrize("env, expected", [
    ({}, "runs/hvdtrain"),
    ({"SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "hvdtrain"}, "runs/hvdtrain-4242"),
    ({"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "my run/2 .."}, "runs/my_run_2-77"),
    ({"SLURM_JOB_ID": "77"}, "runs/job-77"),
])
def test_the_default_output_folder_names_the_slurm_job(env, expected):
    assert run_folder.default_output_dir(env) == expected
    assert run_folder.resolve_output_dir("auto", env) == expected
    assert run_folder.resolve_output_dir("/mine", env) == "/mine"  # what the user set stays


def test_a_requeued_job_finds_its_folder_and_another_job_gets_its_own(monkeypatch):
    # scontrol requeue keeps the job id: the config of the rerun names the same folder
    monkeypatch.setenv("SLURM_JOB_NAME", "train.sbatch")
    monkeypatch.setenv("SLURM_JOB_ID", "101")
    first = load_config("debug", ["output.dir=auto"]).output.dir
    assert first == load_config("debug", ["output.dir=auto"]).output.dir == "runs/train.sbatch-101"
    monkeypatch.setenv("SLURM_JOB_ID", "102")
    assert load_config(None, []).output.dir == "runs/train.sbatch-102"  # the default is auto
    monkeypatch.delenv("SLURM_JOB_ID")
    assert load_config(None, []).output.dir == "runs/hvdtrain"  # outside Slurm: the same command resumes


def test_an_output_folder_that_cannot_be_made_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = run_folder.output_dir_problem(blocker / "runs" / "x")
    assert problem.startswith(f"cannot create the output folder '{blocker / 'runs' / 'x'}' (")
    assert "output.dir=" in problem and "\n" not in problem
    assert run_folder.output_dir_problem(tmp_path / "runs" / "ok") is None and (tmp_path / "runs" / "ok").is_dir()


def test_horovodrun_gets_no_cache_where_home_is_not_writable(tmp_path):
    argv = ["-np", "2", "-H", "localhost:2", "python", "x.py"]
    assert launch.without_home_cache(argv, str(tmp_path)) == (argv, "")  # a HOME of one's own
    missing = tmp_path / "no-such-home"
    changed, note = launch.without_home_cache(argv, str(missing))
    assert changed == ["--disable-cache", *argv]
    assert note == (f"hvdtrain launch: HOME ({missing}) is not writable: horovodrun runs without its cache of "
                    f"host checks (--disable-cache; they run again at each start)")
    assert launch.without_home_cache(["--disable-cache", *argv], str(missing)) == (["--disable-cache", *argv], "")


def closed_python(tmp_path: Path) -> Path | None:
    """A Python whose folder others cannot enter: this interpreter's, if it is one (pyenv under
    /root), else None."""
    check = subprocess.run(["bash", str(SHARED_INSTALL), "python-check", sys.executable], capture_output=True,
                           text=True)
    return Path(sys.executable) if check.returncode == 1 else None


def test_a_python_others_cannot_read_is_refused_for_a_shared_install(tmp_path):
    readable = subprocess.run(["bash", str(SHARED_INSTALL), "python-check", "/usr/bin/python3"],
                              capture_output=True, text=True)
    if Path("/usr/bin/python3").exists():
        assert readable.returncode == 0, readable.stderr
    real = closed_python(tmp_path)
    if real is None:
        pytest.skip("this interpreter lives where others can read it (no private Python to refuse)")
    result = subprocess.run(["bash", str(SHARED_INSTALL), "python-check", str(real)], capture_output=True, text=True)
    assert result.returncode == 1
    line = result.stderr.strip()
    assert "\n" not in line and "other users cannot read it" in line and "PYTHON=/usr/bin/python3" in line
    # setup.sh stops with that line before it installs anything
    venv = tmp_path / "opt" / "hvdtrain"
    setup = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], capture_output=True, text=True,
                           env={**os.environ, "HVDTRAIN_VENV": str(venv), "PYTHON": str(real),
                                "HVDTRAIN_SKIP_APT": "1"}, timeout=120)
    assert setup.returncode == 1 and not venv.exists()
    assert setup.stderr.strip() == f"[setup] error: {line}"


def fake_slurm_tools(bin_dir: Path, submitted: Path) -> None:
    """scontrol that reports ``submitted`` as the job's command, srun that runs its command once."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f"#!/bin/sh\necho 'JobId=4242 JobName=hvdtrain'\necho '   Command={submitted}'\n")
    # srun --overlap: the horovodrun script's watcher step, not needed here
    (bin_dir / "srun").write_text('#!/bin/sh\ncase " $* " in *" --overlap "*) exit 0 ;; esac\n'
                                  'while [ "${1#--}" != "$1" ]; do shift; done\nexec "$@"\n')
    for tool in ("scontrol", "srun"):
        (bin_dir / tool).chmod(0o755)


@pytest.mark.parametrize("layout", ["checkout", "shared"])
def test_the_batch_script_finds_the_install_from_where_it_was_submitted(tmp_path, layout):
    """Slurm runs a copy of the batch script (from its spool folder); the script finds the install
    from the path it was submitted by, and runs in the submit folder."""
    if layout == "checkout":  # <checkout>/hostfiles/slurm/train.sbatch next to <checkout>/.venv
        root = tmp_path / "checkout"
        scripts, python = root / "hostfiles" / "slurm", root / ".venv" / "bin" / "python"
    else:  # <venv>/share/hvdtrain/slurm/train.sbatch of a shared install
        root = tmp_path / "opt" / "hvdtrain"
        scripts, python = root / "share" / "hvdtrain" / "slurm", root / "bin" / "python"
    scripts.mkdir(parents=True)
    python.parent.mkdir(parents=True)
    for shipped in SLURM.iterdir():  # the script and the helpers it sources, side by side
        shutil.copy(shipped, scripts)
    python.write_text('#!/bin/sh\necho "python $0 in $PWD: $*"\n')  # stands in for the install's python
    python.chmod(0o755)
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SLURM / "train.sbatch", spool / "slurm_script")
    fake_slurm_tools(tmp_path / "bin", scripts / "train.sbatch")
    home = tmp_path / "alice"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "HVDTRAIN_DIR")}
    env.update({"PATH": f"{tmp_path / 'bin'}:{env['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
                "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n0", "SLURM_SUBMIT_DIR": str(home)})
    result = subprocess.run(["bash", str(spool / "slurm_script"), "--config", "debug"], cwd=home, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"python {python} in {home}: -P -m hvdtrain --config debug" in result.stdout
    # Nothing found: one line, exit 2
    python.unlink()
    result = subprocess.run(["bash", str(spool / "slurm_script")], cwd=home, env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no hvdtrain install found from this script's location" in result.stderr and "PYTHON=" in result.stderr


def test_the_horovodrun_script_finds_the_install_and_its_host_list_beside_it(tmp_path):
    root = tmp_path / "opt" / "hvdtrain"
    scripts = root / "share" / "hvdtrain" / "slurm"
    scripts.mkdir(parents=True)
    (root / "bin").mkdir()
    for shipped in SLURM.iterdir():
        shutil.copy(shipped, scripts)
    (root / "bin" / "python").write_text('#!/bin/sh\necho "python in $PWD: $*"\n')
    (root / "bin" / "python").chmod(0o755)
    fake_slurm_tools(tmp_path / "bin", scripts / "train-horovodrun.sbatch")
    (tmp_path / "bin" / "scontrol").write_text(
        f"#!/bin/sh\nif [ \"$1\" = show ] && [ \"$2\" = hostnames ]; then echo n0; exit; fi\n"
        f"echo '   Command={scripts / 'train-horovodrun.sbatch'}'\n")
    home = tmp_path / "alice"
    home.mkdir()
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "HVDTRAIN_DIR")}
    env.update({"PATH": f"{tmp_path / 'bin'}:{env['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "2",
                "SLURM_JOB_NODELIST": "n0", "SLURM_TASKS_PER_NODE": "2", "SLURM_SUBMIT_DIR": str(home)})
    spool = tmp_path / "spool"
    spool.mkdir()
    shutil.copy(SLURM / "train-horovodrun.sbatch", spool / "slurm_script")
    result = subprocess.run(["bash", str(spool / "slurm_script"), "--config", "debug"], cwd=home, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    python = root / "bin" / "python"
    launched = f"-P -m hvdtrain launch -np 2 -H n0:2 {python} -P -m hvdtrain --config debug"
    assert f"python in {home}: {launched}" in result.stdout


def test_make_setup_passes_the_prefix_and_the_python():
    dry = subprocess.run(["make", "-n", "setup", "VENV=/opt/hvdtrain", "PYTHON=/usr/bin/python3"], cwd=REPO,
                         capture_output=True, text=True)
    assert dry.returncode == 0, dry.stderr
    command = dry.stdout.replace("\\\n\t", "")  # the recipe's continued line, as the shell reads it
    assert 'HVDTRAIN_VENV="/opt/hvdtrain" PYTHON="/usr/bin/python3" bash scripts/setup.sh' in command
    default = subprocess.run(["make", "-n", "setup"], cwd=REPO, capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if k not in ("HVDTRAIN_VENV", "PYTHON", "VENV")})
    assert f'HVDTRAIN_VENV="{REPO / ".venv"}"' in default.stdout



def run_copy(script: Path, tmp_path: Path, home: Path, **extra: str) -> subprocess.CompletedProcess:
    """``script``, as Slurm runs a user's copy (spool copy, submitted from ``home``), with stand-ins
    for scontrol and srun and no PYTHON or HVDTRAIN_DIR."""
    spool = tmp_path / "spool"
    spool.mkdir(exist_ok=True)
    shutil.copy(script, spool / "slurm_script")
    shutil.rmtree(tmp_path / "bin", ignore_errors=True)
    fake_slurm_tools(tmp_path / "bin", script)
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "HVDTRAIN_DIR")}
    env.update({"PATH": f"{tmp_path / 'bin'}:{env['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1",
                "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "n0", "SLURM_SUBMIT_DIR": str(home), **extra})
    return subprocess.run(["bash", str(spool / "slurm_script"), "--config", "debug"], cwd=home, env=env,
                          capture_output=True, text=True, timeout=60)


def test_a_users_own_copy_of_the_batch_script_finds_the_install(tmp_path):
    """`hvdtrain slurm-script > my.sbatch`: a copy kept anywhere finds the install's Python and its
    helper scripts; a plain copy of the shipped script says in one line how to get one that does."""
    from hvdtrain.launch import slurm_script

    printed = subprocess.run([sys.executable, "-m", "hvdtrain", "slurm-script"], capture_output=True, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert f"installed_python={sys.executable}\n" in printed.stdout
    assert f"installed_scripts={SLURM}\n" in printed.stdout and "srun --mpi=" in printed.stdout
    assert "edit its #SBATCH lines" in printed.stderr
    # The same, for an install whose Python is a stand-in (the real one would train).
    python = tmp_path / "opt" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\necho "python $0 in $PWD: $*"\n')
    python.chmod(0o755)
    home = tmp_path / "alice"
    (home / "scripts").mkdir(parents=True)
    mine = home / "scripts" / "my.sbatch"
    mine.write_text(slurm_script.fill((SLURM / "train.sbatch").read_text(), str(python), SLURM))
    result = run_copy(mine, tmp_path, home)
    assert result.returncode == 0, result.stderr
    assert f"python {python} in {home}: -P -m hvdtrain --config debug" in result.stdout
    # A plain copy: no install beside it, none recorded.
    plain = home / "scripts" / "copy.sbatch"
    shutil.copy(SLURM / "train.sbatch", plain)
    result = run_copy(plain, tmp_path, home)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "hvdtrain slurm-script > my.sbatch" in result.stderr
    # ... unless PYTHON names a shared install, whose share/ folder has the helpers.
    shutil.copytree(SLURM, tmp_path / "opt" / "share" / "hvdtrain" / "slurm")
    result = run_copy(plain, tmp_path, home, PYTHON=str(python))
    assert result.returncode == 0, result.stderr
    assert f"python {python} in {home}: -P -m hvdtrain --config debug" in result.stdout


def test_a_shared_install_records_its_path_in_its_batch_scripts(tmp_path):
    venv = tmp_path / "opt" / "hvdtrain"
    result = subprocess.run(["bash", str(SHARED_INSTALL), "slurm-scripts", str(venv)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for name in ("train.sbatch", "train-horovodrun.sbatch"):
        text = (venv / "share" / "hvdtrain" / "slurm" / name).read_text()
        assert f"\ninstalled_python={venv}/bin/python\n" in text
        assert f"\ninstalled_scripts={venv}/share/hvdtrain/slurm\n" in text
