"""The user's environment mistakes in one line, exit 2 (hvdtrain/environment.py): a module of theirs
that hides an installed one (named, with the file that hides it), and data this user may not read;
the doctor says the same."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvdtrain import environment
from hvdtrain.data.files import index
from hvdtrain.tools import doctor_checks

REPO = Path(__file__).resolve().parents[2]


def test_a_module_of_the_users_that_hides_an_installed_one_is_named(tmp_path):
    (tmp_path / "yaml.py").write_text("")
    (tmp_path / "numpy").mkdir()  # a folder without __init__.py is a namespace package: it hides nothing
    installed = str(Path(environment.__file__).resolve().parents[1])
    path = [str(tmp_path), *sys.path]
    line = environment.shadowed("yaml", path=path, folders=environment.install_folders())
    assert line.startswith(f"module 'yaml' is shadowed by {tmp_path / 'yaml.py'} (")
    assert "which hides the installed " in line and line.endswith(f"take {tmp_path} off PYTHONPATH")
    assert environment.shadowed("numpy", path=path) is None
    assert environment.shadowed("yaml") is None  # this interpreter's own path
    assert installed in environment.install_folders()


def run_cli(args: list[str], cwd: Path, pythonpath: str) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": pythonpath, "HVDTRAIN_CACHE": str(cwd / "cache")}
    return subprocess.run([sys.executable, "-m", "hvdtrain", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def test_training_with_a_shadowed_package_stops_in_one_line(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "yaml.py").write_text("raise ImportError('not PyYAML')\n")  # PyYAML hidden: the CLI cannot load
    result = run_cli(["--config", "debug", "data.synthetic=true"], tmp_path, f"{mine}:{REPO}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"hvdtrain: error: module 'yaml' is shadowed by {mine / 'yaml.py'} (on PYTHONPATH), which hides the "
        f"installed {Path(__import__('yaml').__file__).parent}: rename it, or take {mine} off PYTHONPATH")
    (mine / "yaml.py").unlink()
    (tmp_path / "yaml.py").write_text("raise ImportError('not PyYAML')\n")  # in the folder the job runs in:
    result = run_cli(["--config", "debug", "--print-config"], tmp_path, str(REPO))  # never imported from there
    assert result.returncode == 0 and result.stdout.startswith("task: image_classification\n"), result.stderr


def test_data_this_user_may_not_read_is_one_line(tmp_path, tiny_data, monkeypatch):
    closed = tiny_data / "train" / sorted(os.listdir(tiny_data / "train"))[0]
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == closed else real_access(path, mode))
    with pytest.raises(index.DataError) as refused:
        index.check_layout(tiny_data)
    line = str(refused.value)
    assert line.startswith("data.dir: this user (") and f"cannot read '{closed}' (owned by " in line
    assert "ask its owner for read access" in line and "\n" not in line
    facts = doctor_checks.probe_facts(str(tiny_data), None)
    assert facts["data_dir"]["unreadable"] == line  # the doctor says the same
    problems = doctor_checks.folder_problems([type("Host", (), {"name": "node0", "facts": facts})()])
    assert problems == [f"node0: {line}"]


def test_a_data_dir_inside_a_folder_this_user_may_not_enter_is_one_line(tmp_path, monkeypatch):
    # The folder's owner and mode come from environment.describe; the index's own describe (what rank 0
    # broadcasts about an index) has the same name and once shadowed it here.
    parent = tmp_path / "closed"
    parent.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if Path(path) == parent else real_access(path, mode))
    with pytest.raises(index.DataError) as refused:
        index.check_layout(parent / "imagenet")
    line = str(refused.value)
    assert line.startswith("data.dir: this user (") and f"cannot enter '{parent}' (owned by " in line, line
    assert line.endswith(f"so '{parent / 'imagenet'}' cannot be read: ask its owner for access") and "\n" not in line


def test_a_permission_error_is_one_line_naming_the_file_and_its_owner(tmp_path):
    target = tmp_path / "ratings.csv"
    target.write_text("")
    line = environment.permission_line(PermissionError(errno.EACCES, "Permission denied", str(target)))
    assert line.startswith(f"permission denied: '{target}' (owned by ")
    assert ", mode -rw-" in line and "\n" not in line
