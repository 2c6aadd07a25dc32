"""``hvdtrain slurm-script``: a Slurm batch script of one's own that finds this install.

The shipped scripts (hostfiles/slurm, or VENV/share/hvdtrain/slurm of a shared install) find the
install from their own location. A user who copies one to edit its ``#SBATCH`` lines moves it away
from there: the copy found no Python, or no ``requeue.sh``. This command prints the script with the
install's Python and the folder of its helper scripts (requeue.sh, hostlist.sh) written in
(``installed_python=``, ``installed_scripts=``), so that the copy runs from anywhere::

    hvdtrain slurm-script > my.sbatch                 # srun (train.sbatch)
    hvdtrain slurm-script --horovodrun > my.sbatch    # horovodrun (train-horovodrun.sbatch)

A shared install's setup writes the same two lines into its own copies (scripts/shared-install.sh).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

SCRIPTS = {False: "train.sbatch", True: "train-horovodrun.sbatch"}
HELPERS = ("requeue.sh", "hostlist.sh")


class SlurmScriptError(Exception):
    """No shipped script to start from: one line, exit 2."""


def script_folders(prefix: str | None = None) -> list[Path]:
    """Where the shipped scripts may be: beside the package in a checkout (hostfiles/slurm), or in
    the install's share folder (a copy install, scripts/shared-install.sh)."""
    package = Path(__file__).resolve().parents[1]
    return [package.parent / "hostfiles" / "slurm", Path(prefix or sys.prefix) / "share" / "hvdtrain" / "slurm"]


def find_scripts(folders: list[Path]) -> Path:
    for folder in folders:
        if all((folder / name).is_file() for name in (*SCRIPTS.values(), *HELPERS)):
            return folder
    raise SlurmScriptError(f"no Slurm batch scripts found for this install (looked in {', '.join(map(str, folders))}): "
                           f"reinstall hvdtrain (make setup), or copy hostfiles/slurm from a checkout")


def fill(text: str, python: str, scripts: Path) -> str:
    """``text`` with the install's Python and helper folder written into its ``installed_python=``
    and ``installed_scripts=`` lines (empty in a checkout, a shared install's own in its copies)."""
    values = {"installed_python": shlex.quote(python), "installed_scripts": shlex.quote(str(scripts))}
    lines, found = [], set()
    for line in text.splitlines(keepends=True):
        name = line.split("=", 1)[0]
        if name in values and "=" in line and name not in found:
            found.add(name)
            line = f"{name}={values[name]}\n"
        lines.append(line)
    if found != set(values):
        raise SlurmScriptError(f"the batch script in {scripts} has no installed_python= and installed_scripts= lines "
                               f"to fill (an older copy?): reinstall hvdtrain")
    return "".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdtrain slurm-script",
        description="Print a Slurm batch script that runs this install of hvdtrain from wherever it is kept: "
                    "hvdtrain slurm-script > my.sbatch, edit its #SBATCH lines, then sbatch my.sbatch --config ...")
    parser.add_argument("--horovodrun", action="store_true",
                        help="the script that launches with horovodrun (train-horovodrun.sbatch) instead of srun")
    args = parser.parse_args(argv)
    try:
        folder = find_scripts(script_folders())
        text = fill((folder / SCRIPTS[args.horovodrun]).read_text(), sys.executable, folder)
    except SlurmScriptError as error:
        print(f"hvdtrain slurm-script: error: {error}", file=sys.stderr, flush=True)
        return 2
    sys.stdout.write(text)
    sys.stdout.flush()
    print(f"hvdtrain slurm-script: {SCRIPTS[args.horovodrun]} for the install of {sys.executable} (helpers in "
          f"{folder}); edit its #SBATCH lines, then: sbatch my.sbatch --config ...", file=sys.stderr, flush=True)
    return 0
