"""A second Unix user for the security tests: the one who plants files in a shared folder.

CI runs as root, so the tests can make a user with ``useradd`` and act as them with ``runuser``;
elsewhere the tests that need one are skipped with the reason. The user is made on first use and
deleted when the test session ends. Plain helpers: the test modules make their fixtures of them.
"""

from __future__ import annotations

import atexit
import grp
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

# One user per pytest-xdist worker ("gw0", "gw1"): each worker makes and removes its own.
ATTACKER = "sec49b" + os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
_made: list[str] = []
_made_groups: list[str] = []


def why_not() -> str | None:
    """Why no second user can be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (useradd, runuser)"
    if not (shutil.which("useradd") and shutil.which("runuser")):
        return "needs useradd and runuser"
    return None


def user(name: str = ATTACKER) -> pwd.struct_passwd:
    """The user ``name``, made (no home, no login shell) if missing and removed at exit."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir", f"/nonexistent/{name}",
                        "--shell", "/bin/sh", name], check=True, capture_output=True)
        if not (_made or _made_groups):
            atexit.register(_remove)
        _made.append(name)
        return pwd.getpwnam(name)


def group(members: list[str], name: str = ATTACKER + "g") -> grp.struct_group:
    """A group ``name`` (a project's) with ``members`` in it, made if missing and removed at exit."""
    try:
        grp.getgrnam(name)
    except KeyError:
        subprocess.run(["groupadd", "--system", name], check=True, capture_output=True)
        if not (_made or _made_groups):
            atexit.register(_remove)
        _made_groups.append(name)
    for member in members:
        subprocess.run(["gpasswd", "-a", member, name], check=True, capture_output=True)
    return grp.getgrnam(name)


def _remove() -> None:
    for name in _made:
        subprocess.run(["userdel", name], capture_output=True)
    for name in _made_groups:
        subprocess.run(["groupdel", name], capture_output=True)


def as_user(name: str, script: str, cwd: str | os.PathLike = "/") -> subprocess.CompletedProcess:
    """Run the shell ``script`` as ``name`` (``sh -c``); raises when it fails."""
    result = subprocess.run(["runuser", "-u", name, "--", "sh", "-c", script], cwd=cwd, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, f"as {name}: {script}\n{result.stderr}"
    return result


def scratch() -> Path:
    """A folder everyone may write, like /tmp or a scratch file system (mode 1777), under /tmp (a
    test's own tmp_path is private to root); the caller removes it."""
    path = Path(tempfile.mkdtemp(prefix="sec49-scratch-", dir="/tmp"))
    path.chmod(0o1777)
    return path


# What the attacker plants in a scratch folder for the victim's next run: her run folder (mode 777)
# with links to the victim's files where hvdtrain writes (format with home=the victim's folder).
PLANT = ("mkdir -m 777 run && ln -s {home}/.bashrc_test run/config.yaml && ln -s {home}/notes.txt run/metrics.jsonl"
         " && ln -s {home}/attempts run/attempts.jsonl && ln -s {home}/ranks run/ranks.tsv"
         " && ln -s {home}/.bashrc_test run/report.png && ln -s {home}/notes.txt run/summary.txt")


def victim_home(scratch_folder: Path) -> Path:
    """The victim's private folder (0700) in ``scratch_folder``, with two files the attacker's links name."""
    home = scratch_folder / "victim-home"
    home.mkdir(mode=0o700)
    (home / ".bashrc_test").write_text("the victim's shell setup\n")
    (home / "notes.txt").write_text("the victim's notes\n")
    return home


def untouched(home: Path) -> None:
    """The victim's folder as victim_home made it: no file changed, none added."""
    assert (home / ".bashrc_test").read_text() == "the victim's shell setup\n"
    assert (home / "notes.txt").read_text() == "the victim's notes\n"
    assert sorted(p.name for p in home.iterdir()) == [".bashrc_test", "notes.txt"]
