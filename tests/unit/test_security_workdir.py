"""Files in the folder a job starts in never run as the user: a shipped config's name is the shipped
config, never a file of that name there, and neither ``python -m hvdtrain`` nor ``python -P -m
hvdtrain`` imports a module from that folder. Another user (made with ``useradd``) plants the files
in a folder anyone can write, as on a cluster's scratch file system."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain.config import PACKAGED_CONFIGS, ConfigError
from hvdtrain.config.files import resolve_config_path
from hvdtrain.environment import CLI_IMPORTS
from tests import users

REPO = Path(__file__).resolve().parents[2]
# A config that names a task file: importing it is running it. And modules that PyYAML's, or
# hvdtrain's own, import would find first if the working folder were on sys.path.
PLANT = """cat > debug <<'EOF'
task: ./evil.py:Evil
train: {{epochs: 77}}
EOF
cp debug debug.yml
for name in evil yaml typing_extensions; do
  echo "open('{marker}', 'a').write('$name ran; ')" > $name.py
done
mkdir hvdtrain && echo "open('{marker}', 'a').write('hvdtrain/ ran; '); raise SystemExit(9)" > hvdtrain/__init__.py
"""


@pytest.fixture
def planted():
    if users.why_not():
        pytest.skip(users.why_not())
    users.user()
    folder = users.scratch()
    marker = folder / "ran.txt"
    users.as_user(users.ATTACKER, PLANT.format(marker=marker), cwd=folder)
    assert (folder / "yaml.py").stat().st_uid == users.user().pw_uid
    marker.touch()
    marker.chmod(0o666)  # whatever ran, as whoever, could say so
    yield folder, marker
    shutil.rmtree(folder)


def hvdtrain_cli(python_options: list[str], args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(REPO), "HVDTRAIN_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, *python_options, "-m", "hvdtrain", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_shipped_configs_name_never_takes_a_file_from_the_working_folder(planted, monkeypatch):
    folder, _ = planted
    monkeypatch.chdir(folder)
    assert resolve_config_path("debug") == PACKAGED_CONFIGS / "debug.yaml"
    assert resolve_config_path("./debug") == Path("./debug")  # given as a path: the user's choice
    assert resolve_config_path("debug.yml") == Path("debug.yml")
    with pytest.raises(ConfigError) as refused:
        resolve_config_path("debug2")
    assert str(refused.value).startswith("no shipped config named 'debug2' (shipped: ")
    assert str(refused.value).endswith("; a file of your own is given as a path, e.g. --config ./debug2.yaml")
    with pytest.raises(ConfigError, match=r"^config file 'nope\.yaml' not found \(a path is relative"):
        resolve_config_path("nope.yaml")


@pytest.mark.parametrize("python_options", [[], ["-P"]], ids=["python-m", "python-P-m"])
def test_no_module_in_the_working_folder_is_imported(planted, python_options):
    folder, marker = planted
    clean = folder / "clean"
    clean.mkdir()
    expected = hvdtrain_cli(["-P"], ["--config", "debug", "--print-config"], clean)
    assert expected.returncode == 0, expected.stderr
    if not python_options:  # python -m finds a planted hvdtrain/ before any code of hvdtrain's runs
        (folder / "hvdtrain" / "__init__.py").unlink()
    result = hvdtrain_cli(python_options, ["--config", "debug", "--print-config"], folder)
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected.stdout and "epochs: 77" not in result.stdout
    assert marker.read_text() == ""  # neither ./evil.py, ./yaml.py, ./typing_extensions.py nor ./hvdtrain/


def test_a_module_on_pythonpath_that_hides_a_dependency_never_runs(planted):
    """A folder on PYTHONPATH is the user's choice, but a yaml.py another user put there is named in one
    line before PyYAML's import would run it (it used to run, then fail the import)."""
    folder, marker = planted
    users.as_user(users.ATTACKER, "mkdir -m 755 lib && cp yaml.py lib/", cwd=folder)
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": f"{folder / 'lib'}:{REPO}", "HVDTRAIN_CACHE": str(folder / "c")}
    result = subprocess.run([sys.executable, "-P", "-m", "hvdtrain", "--config", "debug", "--print-config"],
                            cwd=folder / "lib", env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"hvdtrain: error: module 'yaml' is shadowed by {folder / 'lib' / 'yaml.py'} "
                                    f"(on PYTHONPATH), which hides the installed ") and result.stderr.count("\n") == 1
    assert marker.read_text() == ""
    code = ("import sys; before = set(sys.modules); import hvdtrain.cli; from hvdtrain.environment import "
            "DEPENDENCIES; print(*sorted(name for name in DEPENDENCIES if name in set(sys.modules) - before))")
    imported = subprocess.run([sys.executable, "-P", "-c", code], env=env | {"PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=120)
    assert imported.stdout.split() == sorted(CLI_IMPORTS), imported  # the CLI's imports are checked first


def test_the_module_run_is_found_past_interpreter_options():
    from hvdtrain import _module_run

    assert _module_run(["python", "-u", "-m", "hvdtrain", "--config", "debug"]) == "hvdtrain"  # torchrun's ranks
    assert _module_run(["python", "-B", "-mhvdtrain"]) == "hvdtrain"
    assert _module_run(["python", "-W", "ignore", "-X", "importtime", "-m", "hvdtrain"]) == "hvdtrain"
    assert _module_run(["python", "my_train.py", "-m", "hvdtrain"]) is None  # a script of the user's
    assert _module_run(["python", "-c", "import hvdtrain"]) is None
    assert _module_run(["python", "-m", "pytest"]) == "pytest"
