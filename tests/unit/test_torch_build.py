"""scripts/setup.sh's choice of torch build (HVDTRAIN_TORCH, `make setup TORCH=cpu`): what it asks
pip for, run end to end with the torch engine (no Horovod) against a venv whose python is a stand-in
that records pip's arguments instead of downloading. (A real install from PyPI or PyTorch's index
is not run here: it downloads gigabytes.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SETUP = REPO / "scripts" / "setup.sh"
WHEELS = REPO / "scripts" / "torch-wheels.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
PINS = "torch==2.13.0 torchvision==0.28.0"

# The venv's python: `-m pip install/uninstall/list` are recorded (install of torch== sets the
# build the index would serve: cpu from PyTorch's CPU index, else $SERVES or cuda; uninstall drops
# it); `-c` asking torch's build answers it, or fails as without torch; the rest runs the real one.
STANDIN = f"""#!/bin/bash
if [[ "$1 $2" == "-m pip" ]]; then
    echo "pip ${{*:3}}" >> "$STATE/calls"
    case $3 in
        install) served=${{SERVES:-cuda}}
                 [[ " $* " != *" --index-url {CPU_INDEX} "* ]] || served=cpu
                 [[ " $* " != *" torch=="* ]] || echo "$served" > "$STATE/build" ;;
        uninstall) rm -f "$STATE/build" ;;
        list) cat "$STATE/freeze" ;;
    esac
    exit 0
fi
if [[ $1 == -c && $2 == *torch.version* ]]; then
    [[ -s $STATE/build ]] || exit 1
    cat "$STATE/build"; exit 0
fi
if [[ $1 == -c && $2 == *hvdtrain.comm.torch_engine* ]]; then
    echo "torch 2.13.0+$(cat "$STATE/build"), torchvision 0.28.0"; exit 0
fi
exec {sys.executable} "$@"
"""
FREEZE = """numpy==2.4.6
nvidia-cublas==13.1.1.3
nvidia-nccl-cu13==2.29.7
torch==2.13.0
torchvision==0.28.0
triton==3.7.1
tqdm==4.70.1
"""


def venv(tmp_path: Path, build: str | None = None, marker: str | None = None) -> Path:
    """A venv whose python is the stand-in, with torch's ``build`` installed (None: no torch) and
    setup's record of the build it chose (``marker``; None: a venv from before the choice)."""
    root = tmp_path / "venv"
    (root / "bin").mkdir(parents=True)
    python = root / "bin" / "python"
    python.write_text(STANDIN)
    python.chmod(0o755)
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "freeze").write_text(FREEZE if build else "numpy==2.4.6\n")
    if build:
        (tmp_path / "state" / "build").write_text(build)
    if marker:
        (root / ".hvdtrain-torch-build").write_text(marker + "\n")
    return root


def setup(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """scripts/setup.sh for the torch engine into the stand-in venv: its result and pip's calls."""
    result = subprocess.run(
        ["bash", str(SETUP)], capture_output=True, text=True, timeout=120,
        env={**os.environ, "HVDTRAIN_ENGINE": "torch", "HVDTRAIN_VENV": str(tmp_path / "venv"),
             "HVDTRAIN_EDITABLE": "1", "HVDTRAIN_SKIP_APT": "1", "STATE": str(tmp_path / "state"), **env})
    calls = tmp_path / "state" / "calls"
    return result, calls.read_text().splitlines() if calls.exists() else []


def installs(calls: list[str]) -> list[str]:
    return [call for call in calls if call.startswith("pip install") and " -e " not in call]


@pytest.fixture(autouse=True)
def needs_the_packages_setup_checks():
    missing = [name for name in ("procps", "iproute2", "python3", "python3-venv")
               if "install ok installed" not in subprocess.run(["dpkg-query", "-W", "-f=${Status}", name],
                                                               capture_output=True, text=True).stdout]
    if missing:
        pytest.skip(f"setup.sh checks for Debian packages that are not installed: {missing}")


def test_cpu_installs_pytorchs_cpu_wheels_from_their_index_and_the_rest_from_the_registry(tmp_path):
    venv(tmp_path)
    result, calls = setup(tmp_path, HVDTRAIN_TORCH="cpu")
    assert result.returncode == 0, result.stderr + result.stdout
    torch_call, rest = installs(calls)
    assert torch_call == f"pip install -q --index-url {CPU_INDEX} {PINS}"
    assert "--index-url" not in rest and "torch" not in rest and "tqdm==4.70.1" in rest, rest
    assert not [call for call in calls if call.startswith("pip uninstall")]
    assert f"installing {PINS} (its cpu build from {CPU_INDEX})" in result.stdout
    assert "for the torch engine (torch 2.13.0+cpu" in result.stdout
    assert (tmp_path / "venv" / ".hvdtrain-torch-build").read_text() == "cpu\n"


def test_the_default_is_the_registrys_build_as_before(tmp_path):
    venv(tmp_path)
    result, calls = setup(tmp_path)
    assert result.returncode == 0, result.stderr + result.stdout
    assert installs(calls)[0] == f"pip install -q {PINS}"
    assert (tmp_path / "venv" / ".hvdtrain-torch-build").read_text() == "cuda\n"


def test_a_venv_with_the_cuda_build_has_it_replaced_and_back(tmp_path):
    """A venv set up before (CUDA build, no record of the choice), asked for cpu: torch, torchvision,
    triton and the nvidia-* libraries are uninstalled first (pip would take the installed 2.13.0
    for the pin), nothing else. Asked for cuda again, the cpu build is replaced the same way."""
    venv(tmp_path, build="cuda")
    result, calls = setup(tmp_path, HVDTRAIN_TORCH="cpu")
    assert result.returncode == 0, result.stderr + result.stdout
    uninstall = [call for call in calls if call.startswith("pip uninstall")]
    assert uninstall == ["pip uninstall -q -y nvidia-cublas nvidia-nccl-cu13 torch torchvision triton"], calls
    assert calls.index(uninstall[0]) < calls.index(installs(calls)[0])
    assert "replacing torch's cuda build with its cpu build" in result.stdout
    (tmp_path / "state" / "calls").unlink()
    result, calls = setup(tmp_path, HVDTRAIN_TORCH="cuda")
    assert result.returncode == 0, result.stderr + result.stdout
    assert [call for call in calls if call.startswith("pip uninstall")] == [
        "pip uninstall -q -y nvidia-cublas nvidia-nccl-cu13 torch torchvision triton"], calls
    assert installs(calls)[0] == f"pip install -q {PINS}"
    # The registry's build again, in a venv that already has it: nothing uninstalled.
    (tmp_path / "state" / "calls").unlink()
    (tmp_path / "venv" / ".hvdtrain-setup.stamp").unlink()
    result, calls = setup(tmp_path)
    assert result.returncode == 0 and not [call for call in calls if call.startswith("pip uninstall")], calls


def test_a_mirror_of_the_index_is_taken_and_one_that_serves_another_build_stops_setup(tmp_path):
    venv(tmp_path)
    mirror = "https://mirror.example/pytorch/whl/cpu"
    result, calls = setup(tmp_path, HVDTRAIN_TORCH="cpu", HVDTRAIN_TORCH_INDEX=mirror, SERVES="cpu")
    assert result.returncode == 0, result.stderr
    assert installs(calls)[0] == f"pip install -q --index-url {mirror} {PINS}"
    for name in ("venv/.hvdtrain-setup.stamp", "venv/.hvdtrain-torch-build", "state/build"):
        (tmp_path / name).unlink()
    result, _ = setup(tmp_path, HVDTRAIN_TORCH="cpu", HVDTRAIN_TORCH_INDEX="https://mirror.example/simple")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"[setup] error: asked for torch's CPU-only build, but {tmp_path / 'venv'} has its cuda build (pip install "
        f"--index-url https://mirror.example/simple {PINS})"], result.stderr


@pytest.mark.parametrize("env, says", [
    ({"HVDTRAIN_TORCH": "gpu"}, "HVDTRAIN_TORCH must be cuda (the default: runs with or without a GPU) or cpu (no "
                                "CUDA libraries, for nodes without a GPU), not 'gpu'"),
    ({"HVDTRAIN_TORCH": "cpu", "HVDTRAIN_GPU_OPS": "nccl"}, "HVDTRAIN_GPU_OPS=nccl needs torch's CUDA build, and "
                                                            "HVDTRAIN_TORCH=cpu asks for the CPU-only one"),
    ({"HVDTRAIN_TORCH": "cpu", "HVDTRAIN_SYSTEM_TORCH": "1"}, "HVDTRAIN_SYSTEM_TORCH keeps the base Python's torch, "
                                                              "and HVDTRAIN_TORCH=cpu asks for another"),
])
def test_a_choice_setup_cannot_honour_is_one_line_before_anything_is_installed(tmp_path, env, says):
    venv(tmp_path)
    result, calls = setup(tmp_path, **env)
    assert result.returncode == 1 and calls == [], (result.stderr, calls)
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr, result.stderr


def test_make_setup_passes_torch_on_and_leaves_the_default_to_setup():
    def dry_run(*args: str) -> str:
        return subprocess.run(["make", "-n", "setup", *args], cwd=REPO, capture_output=True, text=True,
                              env={k: v for k, v in os.environ.items() if k != "HVDTRAIN_TORCH"}).stdout

    assert 'HVDTRAIN_TORCH="cpu"' in dry_run("TORCH=cpu")
    assert 'HVDTRAIN_TORCH=""' in dry_run()  # setup's default, cuda; HVDTRAIN_SYSTEM_TORCH=1 is not contradicted


def test_the_packages_a_build_change_replaces():
    freeze = FREEZE + "pytorch-triton-rocm==3.1.0\ntorchaudio==2.13.0\nnvidia_foo @ file:///x.whl\n-e /src/hvdtrain\n"
    listed = subprocess.run(["bash", "-c", f'source "{WHEELS}"; torch_build_packages'], input=freeze,
                            capture_output=True, text=True, check=True).stdout.split()
    assert listed == ["nvidia-cublas", "nvidia-nccl-cu13", "torch", "torchvision", "triton", "pytorch-triton-rocm"]
