"""The user's environment mistakes, each in one line (exit 2) instead of a traceback from every rank.

- **A module shadowed on the path.** ``PYTHONPATH`` puts its folders before the install (the folder
  a job runs in is not on ``sys.path``: hvdtrain/__init__.py takes it off): a ``yaml.py`` or ``numpy/``
  of one's own there hides the installed package, and the import fails deep inside torch or
  hvdtrain (``partially initialized module``, ``has no attribute``). ``shadowed`` names the file
  that hides it and the copy it hides; ``check_dependencies`` looks for the packages a rank
  imports before any of them is imported (``python -m hvdtrain`` calls it first thing, through
  ``refuse_shadowed``: such a module never runs), and ``explain`` turns a failed import into that line.
- **A file or folder this user cannot read** (``PermissionError``): ``permission_line`` names it,
  its owner and mode.

Light on purpose (no torch, no Horovod): the CLI runs it before either is imported, and the
doctor's probe on every host.
"""

from __future__ import annotations

import os
import pwd
import re
import site
import stat
import sys
from pathlib import Path
from typing import Sequence

# The packages a rank imports (pyproject.toml's, torch and Horovod), by module name.
DEPENDENCIES = ("torch", "torchvision", "horovod", "numpy", "PIL", "yaml", "tensorboardX", "tqdm", "psutil",
                "simplejpeg")


# Those the CLI imports before it runs a command (config/: PyYAML; numpy): refused first thing
# (``refuse_shadowed``); the others before a command imports them (cli.py, doctor_checks.py).
CLI_IMPORTS = ("yaml", "numpy")


class EnvironmentProblem(Exception):
    """The user's environment, not the config or the data set, stops the job: one line, exit 2."""


def install_folders() -> list[str]:
    """The folders whose modules are the install's: the interpreter's and the venv's (standard
    library, site-packages), the user's site-packages, and the folder hvdtrain itself is
    imported from (a checkout on PYTHONPATH)."""
    folders = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
               str(Path(__file__).resolve().parents[1])}
    try:
        folders.update(site.getsitepackages())
    except AttributeError:  # an old virtualenv's site module
        pass
    user_site = site.getusersitepackages() if hasattr(site, "getusersitepackages") else None
    if isinstance(user_site, str):
        folders.add(user_site)
    return sorted({os.path.realpath(folder) for folder in folders if folder})


def is_install_entry(entry: str, folders: Sequence[str]) -> bool:
    real = os.path.realpath(entry or os.getcwd())
    return any(real == folder or real.startswith(folder.rstrip(os.sep) + os.sep) for folder in folders)


def module_file(entry: str, name: str) -> str | None:
    """The file by which ``import name`` would find a module in the path entry ``entry``, or None
    (a folder without ``__init__.py`` is a namespace package: an installed one found later wins)."""
    folder = entry or os.getcwd()
    candidates = [os.path.join(folder, name, "__init__.py"), os.path.join(folder, f"{name}.py")]
    for candidate in candidates:
        if os.path.isfile(candidate):
            return candidate
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    for found in names:  # an extension module: name.cpython-311-x86_64-linux-gnu.so
        if found.split(".", 1)[0] == name and found.endswith((".so", ".pyd")):
            return os.path.join(folder, found)
    return None


def shadowed(name: str, path: Sequence[str] | None = None, folders: Sequence[str] | None = None) -> str | None:
    """One line when the first module ``name`` on the path is the user's and hides an installed one;
    else None."""
    path = sys.path if path is None else path
    folders = install_folders() if folders is None else folders
    top = name.split(".")[0]
    for index, entry in enumerate(path):
        found = module_file(entry, top)
        if found is None:
            continue
        if is_install_entry(entry, folders):
            return None
        hidden = next((f for e in path[index + 1:] if is_install_entry(e, folders)
                       for f in [module_file(e, top)] if f is not None), None)
        if hidden is None:
            return None  # the user's own module, hiding nothing installed
        return (f"module '{top}' is shadowed by {found} ({where(entry)}), which hides the installed "
                f"{os.path.dirname(hidden) if hidden.endswith('__init__.py') else hidden}: rename it, or take "
                f"{entry or os.getcwd()} off PYTHONPATH")
    return None


def where(entry: str) -> str:
    """How ``entry`` came to be on sys.path, in the user's terms."""
    listed = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    real = os.path.realpath(entry or os.getcwd())
    if any(os.path.realpath(p) == real for p in listed):
        return "on PYTHONPATH"
    if not entry or real == os.path.realpath(os.getcwd()):
        return "in the working folder, which python -c puts first on sys.path"
    return f"in {entry}, on sys.path"


def check_dependencies(names: Sequence[str] = DEPENDENCIES) -> None:
    """Raise EnvironmentProblem for the first package a rank needs that a module of the user's
    hides (before any of them is imported: afterwards, the failed import says it, ``explain``)."""
    folders = install_folders()
    user_entries = [entry for entry in sys.path if not is_install_entry(entry, folders)]
    if not user_entries:
        return
    for name in names:
        line = shadowed(name, folders=folders)
        if line:
            raise EnvironmentProblem(line)


MODULE_IN_MESSAGE = (r"partially initialized module '([\w.]+)'", r"module '([\w.]+)' has no attribute",
                     r"cannot import name '[\w.]+' from '([\w.]+)'", r"No module named '([\w.]+)'")


def failed_module(error: BaseException) -> str | None:
    """The module an ImportError or AttributeError of an import names, if any."""
    name = getattr(error, "name", None) if isinstance(error, ImportError) else None
    if isinstance(name, str) and name:
        return name
    for pattern in MODULE_IN_MESSAGE:
        match = re.search(pattern, str(error))
        if match:
            return match.group(1)
    return None


def explain(error: BaseException) -> str | None:
    """The one line for an import that failed because a module of the user's shadows an installed
    one (the module the error names, or any package a rank needs), else None."""
    if not isinstance(error, (ImportError, AttributeError)):
        return None
    names = [n for n in (failed_module(error),) if n] + list(DEPENDENCIES)
    folders = install_folders()
    for name in dict.fromkeys(n.split(".")[0] for n in names):
        line = shadowed(name, folders=folders)
        if line:
            return line
    return None


def permission_line(error: PermissionError) -> str:
    """``error`` (a file or folder this user may not read or write) as one line with its owner and mode."""
    target = error.filename or ""
    described = describe(target) if target else ""
    return (f"permission denied: '{target}'{f' ({described})' if described else ''}, for user "
            f"{user_name(os.geteuid())}: ask its owner for access (chmod/chgrp), or point the config at files "
            f"of your own")


def describe(path: str) -> str:
    """``owned by alice, mode drwx------`` of ``path``, or of the nearest folder above it that exists."""
    probe = Path(path)
    for candidate in (probe, *probe.parents):
        try:
            info = candidate.lstat()
        except OSError:
            continue
        prefix = "" if candidate == probe else f"{candidate}: "
        return f"{prefix}owned by {user_name(info.st_uid)}, mode {stat.filemode(info.st_mode)}"
    return ""


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def unreadable_line(folder: Path, key: str = "data.dir") -> str | None:
    """One line when this user may not list ``folder`` (of ``key``'s), else None."""
    why = unreadable(folder)
    if why is None:
        return None
    return (f"{key}: this user ({user_name(os.geteuid())}) cannot read '{folder}' ({why}): ask its owner for "
            f"read access, or set {key} to a copy you can read")


def unreadable(folder: Path) -> str | None:
    """None when this user may list ``folder`` and enter it, else what stops it (owner, mode)."""
    if os.access(folder, os.R_OK | os.X_OK):
        return None
    return describe(str(folder)) or "not readable"


def report_import_failure(error: BaseException) -> None:
    """Before the CLI could load (``python -m hvdtrain``'s own imports failed): where a module of the
    user's is the cause, its one line (once per job: ranks other than 0 wait, as outcome.report_error
    does), the launcher's exit record, and exit 2; otherwise return and let the traceback show."""
    line = explain(error)
    if line is None:
        return
    stop(line)


def refuse_shadowed() -> None:
    """Before the CLI's own imports (CLI_IMPORTS): a module on the path that hides one of them (a
    ``yaml.py`` in a folder on PYTHONPATH, another user's or not) stops the job in one line before
    it can be imported, and so before any code in it runs."""
    try:
        check_dependencies(CLI_IMPORTS)
    except EnvironmentProblem as problem:
        stop(str(problem))


def stop(line: str) -> None:
    """``line`` once per job (ranks other than 0 wait, as outcome.report_error does), the launcher's
    exit record, and exit 2."""
    from .comm import launcher_env
    from .launch.records import record_exit

    rank = launcher_env.rank()
    if rank != 0:
        import time

        time.sleep(10.0)  # outcome.PEER_PAUSE_SECONDS (outcome itself cannot be imported here)
    print(f"hvdtrain: error{'' if rank == 0 else f' on rank {rank}'}: {line}", file=sys.stderr, flush=True)
    record_exit(rank, 2, f"error: {line}")
    raise SystemExit(2)
