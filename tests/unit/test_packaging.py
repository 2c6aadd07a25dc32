"""pyproject.toml is the one source of the package's metadata; setup.py only calls setuptools, for the
tools and users that still run it, and both ways give the same package."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_setup_py_only_calls_setuptools():
    code = [line for line in (REPO / "setup.py").read_text().splitlines()
            if line.strip() and not line.startswith(('"""', "#"))]
    assert code == ["from setuptools import setup", "setup()"], code


def test_pip_install_and_setup_py_agree_on_the_version(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md", "LICENSE"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(REPO / "hvdtrain", source / "hvdtrain", ignore=shutil.ignore_patterns("__pycache__"))
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]

    by_setup_py = subprocess.run([sys.executable, "setup.py", "--version"], cwd=source, capture_output=True,
                                 text=True, timeout=120, check=True).stdout.strip().splitlines()[-1]
    # What `pip install .` installs: the wheel pip builds from the checkout, through the same backend.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "wheels"), str(source)], capture_output=True, text=True, timeout=300, check=True)
    (wheel,) = (tmp_path / "wheels").glob("hvdtrain-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        metadata = archive.read(f"hvdtrain-{declared}.dist-info/METADATA").decode()
        names = archive.namelist()
    by_pip = next(line.split(": ", 1)[1] for line in metadata.splitlines() if line.startswith("Version: "))

    assert by_setup_py == by_pip == declared
    assert "hvdtrain/configs/debug.yaml" in names and "hvdtrain/__main__.py" in names  # package data comes along
    assert "Requires-Dist: pyyaml==6.0.3" in metadata
