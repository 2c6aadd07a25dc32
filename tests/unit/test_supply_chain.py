"""What setup installs and what fine-tuning downloads is what was meant. A Horovod
wheel from a wheelhouse is installed only when nobody else can have swapped it (scripts/wheel-check.sh,
run here on its own: the real setup takes minutes), every Python dependency is pinned alike in
scripts/setup.sh and pyproject.toml, and torchvision weights are checked against their published hash."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import torch

from hvdtrain.model.finetune import WeightsError, fetch_torchvision_weights

REPO = Path(__file__).resolve().parents[2]
CHECK = REPO / "scripts" / "wheel-check.sh"
WHEEL_NAME = "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
KEY = "horovod-0.28.1-abc-cp311-torch2.13.0-x86_64-debian12-cpu"


@pytest.fixture
def wheelhouse(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(wheelhouse root, wheel, private destination folder), all private to this user."""
    root = tmp_path / "wheelhouse"
    (root / KEY).mkdir(parents=True)
    wheel = root / KEY / WHEEL_NAME
    wheel.write_bytes(b"PK\x03\x04 a wheel, as far as this test goes")
    for path in (root, root / KEY):
        path.chmod(0o755)
    wheel.chmod(0o644)
    dest = tmp_path / "checked"
    dest.mkdir(mode=0o700)
    return root, wheel, dest


def check(wheel: Path, root: Path, dest: Path, hashes: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CHECK), str(wheel), str(root), str(dest), hashes], capture_output=True,
                          text=True, timeout=30)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_wheel_only_its_owner_can_change_is_copied_and_installed(wheelhouse):
    root, wheel, dest = wheelhouse
    result = check(wheel, root, dest)
    assert result.returncode == 0, result.stderr
    copy = Path(result.stdout.strip())
    assert copy == dest / WHEEL_NAME and copy.read_bytes() == wheel.read_bytes()
    # setup's record beside a wheel it built must match (a damaged copy)
    (wheel.parent / "SHA256SUMS").write_text(f"{sha256(wheel)}  {WHEEL_NAME}\n")
    assert check(wheel, root, dest).returncode == 0
    (wheel.parent / "SHA256SUMS").write_text(f"{'0' * 64}  {WHEEL_NAME}\n")
    result = check(wheel, root, dest)
    assert result.returncode == 1 and "a damaged copy" in result.stderr
    assert not (dest / WHEEL_NAME).exists()  # nothing left to install by mistake


@pytest.mark.parametrize("where, mode", [("root", 0o775), ("root", 0o757), ("key", 0o777), ("wheel", 0o664)],
                         ids=["root-group", "root-others", "key-all", "wheel-group"])
def test_a_wheelhouse_others_can_write_to_is_refused(wheelhouse, where, mode):
    root, wheel, dest = wheelhouse
    path = {"root": root, "key": root / KEY, "wheel": wheel}[where]
    path.chmod(mode)
    result = check(wheel, root, dest)
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"wheel-check: {path.resolve()} can be written by others")
    assert "HVDTRAIN_WHEELHOUSE_SHA256" in lines[0]
    assert not (dest / WHEEL_NAME).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner needs root")
def test_a_wheel_owned_by_another_user_is_refused(wheelhouse):
    root, wheel, dest = wheelhouse
    os.chown(wheel, 12345, 12345)
    result = check(wheel, root, dest)
    assert result.returncode == 1 and "owner uid 12345" in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="changing a folder's owner needs root")
def test_a_folder_above_the_wheelhouse_that_another_user_owns_is_refused(wheelhouse, tmp_path):
    """Whoever owns a folder above the wheelhouse can swap the whole wheelhouse: every folder up to /
    counts, not only those from the wheelhouse down."""
    root, wheel, dest = wheelhouse
    os.chown(tmp_path, 12345, 12345)
    try:
        result = check(wheel, root, dest)
    finally:
        os.chown(tmp_path, 0, 0)
    assert result.returncode == 1 and not (dest / WHEEL_NAME).exists()
    assert result.stderr.startswith(f"wheel-check: {tmp_path} can be written by others than you and root "
                                    f"(owner uid 12345, mode 700)")


def owned_chain(check: str, path: Path) -> tuple[int, str]:
    """scripts/owner-check.sh's owned_chain CHECK PATH, sourced alone: (its status, owned_chain_failed)."""
    script = f'source {REPO / "scripts" / "owner-check.sh"}; owned_chain {check} "$1"; echo "$? $owned_chain_failed"'
    out = subprocess.run(["bash", "-c", script, "bash", str(path)], capture_output=True, text=True, timeout=30)
    status, _, failed = out.stdout.strip().partition(" ")
    return int(status), failed


def test_one_walk_up_the_folders_serves_the_wheel_and_the_setup_cache(tmp_path):
    """wheel-check.sh and sdist-check.sh walk from a file up to / with the same function: it stops at
    the first folder its check refuses and names it; a sticky folder (as /tmp) passes."""
    below = tmp_path / "a" / "b" / "c"
    below.mkdir(parents=True)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", below):
        folder.chmod(0o755)
    assert owned_chain("private_to_owner", below / "file") == (0, "")
    (tmp_path / "a").chmod(0o777)
    (tmp_path / "a" / "b").chmod(0o777)  # the first one up from the file is the one named
    assert owned_chain("private_to_owner", below / "file") == (1, str(tmp_path / "a" / "b"))
    (tmp_path / "a" / "b").chmod(0o1777)
    assert owned_chain("private_to_owner", below / "file") == (1, str(tmp_path / "a"))
    (tmp_path / "a").chmod(0o1777)
    assert owned_chain("private_to_owner", below / "file") == (0, "")
    for name, check in (("wheel-check.sh", "private_to_owner"), ("sdist-check.sh", "owner_only")):
        text = (REPO / "scripts" / name).read_text()
        assert f"owned_chain {check} " in text, f"{name} does not walk up the folders with owned_chain"
        assert "while [[ $path != / ]]" not in text, f"{name} walks up the folders on its own"


def test_a_wheel_swapped_while_it_is_checked_is_never_installed(wheelhouse, tmp_path):
    """The check and the copy read one open file: a wheel renamed over the checked one between the two
    (here from inside the check's own walk up the folders) is noticed, never copied."""
    root, wheel, dest = wheelhouse
    evil = tmp_path / "evil.whl"
    evil.write_bytes(b"PK\x03\x04 the attacker's wheel")
    evil.chmod(0o644)
    tools = tmp_path / "tools"
    tools.mkdir()
    # The first step up from the wheel itself (the script's own dirname, to find owner-check.sh, runs
    # before the wheel is opened).
    (tools / "dirname").write_text(f'#!/bin/sh\nif [ "$2" = "{wheel}" ] && [ ! -e "{tmp_path}/swapped" ]; then '
                                   f'touch "{tmp_path}/swapped"; mv -f "{evil}" "{wheel}"; fi\n'
                                   f'exec {shutil.which("dirname")} "$@"\n')
    (tools / "dirname").chmod(0o755)
    result = subprocess.run(["bash", str(CHECK), str(wheel), str(root), str(dest), ""], capture_output=True, text=True,
                            timeout=30, env={**os.environ, "PATH": f"{tools}:{os.environ['PATH']}"})
    assert (tmp_path / "swapped").exists()  # the swap came during the check
    assert result.returncode == 1 and "was replaced while it was checked" in result.stderr, result.stderr
    assert not (dest / WHEEL_NAME).exists()


def test_given_sums_decide_whoever_can_write_the_folder(wheelhouse):
    root, wheel, dest = wheelhouse
    root.chmod(0o777)  # a shared folder: only the sum the user gave can vouch for the wheel
    right = sha256(wheel)
    result = check(wheel, root, dest, f"{'1' * 64},{right.upper()}")
    assert result.returncode == 0, result.stderr
    result = check(wheel, root, dest, "1" * 64)
    assert result.returncode == 1 and result.stderr == (
        f"wheel-check: the Horovod wheel {wheel} has sha256 {right}, which HVDTRAIN_WHEELHOUSE_SHA256 does not "
        "list: a different or tampered wheel; correct the sums or delete the wheel to compile Horovod\n")


def test_a_link_out_of_the_wheelhouse_is_refused(wheelhouse, tmp_path):
    root, wheel, dest = wheelhouse
    elsewhere = tmp_path / "elsewhere.whl"
    elsewhere.write_bytes(b"other")
    wheel.unlink()
    wheel.symlink_to(elsewhere)
    result = check(wheel, root, dest)
    assert result.returncode == 1 and "leads outside" in result.stderr


def test_setup_installs_prebuilt_wheels_only_through_the_check():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert 'source "$repo/scripts/wheel-check.sh"' in setup
    # every candidate goes through verified_wheel, and what is installed is its checked copy
    loop = setup[setup.index('for root in ${HVDTRAIN_WHEELHOUSE'):setup.index("install_wheel() {")]
    assert 'verified_wheel "$candidate" "$root" "$checked_dir" "$hashes" || {' in loop
    assert "wheel=$checked_wheel" in loop
    assert "sha256sum horovod-\"$horovod_version\"-*.whl >SHA256SUMS" in setup
    # the image build: the script is in the builder, and build-local.sh hands over the sums
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert dockerfile.count("COPY scripts/setup.sh scripts/wheel-check.sh scripts/sdist-check.sh "
                            "scripts/owner-check.sh /opt/hvdtrain/src/scripts/") == 2
    assert "HVDTRAIN_WHEELHOUSE_SHA256=${HVDTRAIN_WHEELHOUSE_SHA256}" in dockerfile
    assert '--build-arg "HVDTRAIN_WHEELHOUSE_SHA256=$sums"' in (REPO / "docker" / "build-local.sh").read_text()


# --- pins ---------------------------------------------------------------------------------------------

def setup_sh_pins() -> dict[str, str]:
    text = (REPO / "scripts" / "setup.sh").read_text()
    pins = {}
    for array in ("torch_pins", "python_pins"):
        body = re.search(rf"^{array}=\(([^)]*)\)", text, re.M).group(1)
        for item in body.split():
            name, sep, version = item.partition("==")
            assert sep and re.fullmatch(r"[0-9][0-9.]*", version), f"setup.sh {array}: '{item}' is not pinned"
            pins[name.lower()] = version
    return pins


def pyproject_requirements() -> list[str]:
    """pyproject.toml's dependencies and every optional dependency."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + [req for reqs in project["optional-dependencies"].values() for req in reqs]


def test_every_python_dependency_is_pinned_alike_in_setup_sh_and_pyproject():
    pins = setup_sh_pins()
    assert {"cloudpickle", "psutil", "packaging", "cffi", "setuptools", "wheel"} <= set(pins)
    requirements = pyproject_requirements()
    assert "pyyaml==6.0.3" in requirements and "mpi4py==4.1.2" in requirements  # both tables were read
    for requirement in requirements:
        name, sep, version = re.sub(r"\[.*\]", "", requirement).partition("==")
        if name in ("torch", "torchvision"):  # pinned by setup.sh; HVDTRAIN_SYSTEM_TORCH keeps an image's own
            assert not sep and name in pins
            continue
        assert sep, f"pyproject.toml: '{requirement}' is not pinned"
        assert pins.get(name.lower(), version) == version, \
            f"pyproject.toml pins {requirement}, setup.sh {pins[name.lower()]}"
    installed = {name: pins[name] for name in ("psutil", "cloudpickle", "pyyaml")}
    import importlib.metadata as metadata
    assert {name: metadata.version(name) for name in installed} == installed  # pinned to what the venv has


# --- torchvision weights --------------------------------------------------------------------------------

def test_downloaded_torchvision_weights_must_match_the_published_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    tampered = b"not the weights torchvision published"

    def download(url: str, target: str, hash_prefix: str | None = None, progress: bool = True) -> None:
        Path(target).write_bytes(tampered)

    # The default download (torch.hub's) is checked: no network needed, the file is what it returns.
    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    with pytest.raises(WeightsError) as error:
        fetch_torchvision_weights("resnet18", "IMAGENET1K_V1")
    digest = hashlib.sha256(tampered).hexdigest()
    assert str(error.value) == (
        f"model.weights=IMAGENET1K_V1: the download of https://download.pytorch.org/models/resnet18-f37072fd.pth has "
        f"SHA-256 {digest[:16]}..., not torchvision's f37072fd... (a corrupted or tampered file; it was deleted): "
        f"try again, or fetch it yourself, check it and place it at {cached}")
    assert list(cached.parent.iterdir()) == []  # neither the file nor a partial one stays in the cache

    # A download that matches lands in the cache, under the name torchvision gives it.
    good = b"weights whose hash the file name carries"
    prefix = hashlib.sha256(good).hexdigest()[:8]
    named = cached.with_name(f"model-{prefix}.pth")
    monkeypatch.setattr("hvdtrain.model.finetune.torchvision_weights_file",
                        lambda arch, spec: (named, f"https://download.pytorch.org/models/{named.name}"))
    assert fetch_torchvision_weights("resnet18", "X", download=lambda url, target: Path(target).write_bytes(good)) \
        == named
    assert named.read_bytes() == good and len(list(cached.parent.iterdir())) == 1
