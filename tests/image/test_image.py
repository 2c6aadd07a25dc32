"""The image built for real (docker/build-local.sh, by `make test-image`) and run: its root file
system is mounted from a `podman create`d container and commands run in it with chroot, since
containers cannot be started on these machines (no container runtime may call setrlimit here).

What a container runtime would do is done by hand: /proc, /sys and /dev bound in, the image's ENV
applied, and an /etc/hosts that names this machine (a runtime writes one; without it, Horovod's Gloo
controller segfaults on the unresolvable host name -- checked below, hvdtrain says so in one line).

Not part of `make test` (collected only with HVDTRAIN_TEST_IMAGE=1, which `make test-image` sets).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("HVDTRAIN_IMAGE", "localhost/hvdtrain:cpu")
CA_BUNDLE = os.environ.get("HVDTRAIN_CA_BUNDLE", "/etc/ssl/certs/ca-certificates.crt")
TINY_DEMO = ["--config", "demo", "train.epochs=1", "train.steps_per_epoch=3", "train.batch_size=8",
             "data.image_size=32", "data.workers=0", "runtime.threads=1", "output.progress=false"]


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True).stdout.strip()


class Root:
    """A writable root file system of the image, with chroot as the way in."""

    def __init__(self, path: Path, env: list[str]):
        self.path, self.env = path, env

    def run(self, command: str, timeout: float = 600) -> subprocess.CompletedProcess:
        cmd = ["chroot", str(self.path), "/usr/bin/env", "-i", *self.env, "HOME=/root", "bash", "-c",
               f"cd /opt/hvdtrain/src && {command}"]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)

    def hosts(self, *lines: str) -> None:
        (self.path / "etc" / "hosts").write_text("".join(line + "\n" for line in lines))


@pytest.fixture(scope="module")
def root():
    try:
        podman("image", "exists", IMAGE)
    except (OSError, subprocess.CalledProcessError):
        pytest.fail(f"no image {IMAGE}: build it first with `bash docker/build-local.sh` (make test-image does)")
    name = f"hvdtrain-image-test-{os.getpid()}"
    podman("create", "--name", name, IMAGE)
    mounts: list[Path] = []
    try:
        path = Path(podman("mount", name))
        for source, target, how in (("proc", "proc", ["-t", "proc"]), ("/sys", "sys", ["--rbind"]),
                                    ("/dev", "dev", ["--rbind"])):
            subprocess.run(["mount", *how, source, str(path / target)], check=True)
            mounts.append(path / target)
            if how == ["--rbind"]:  # unmounting it later must not unmount the host's own /dev/*
                subprocess.run(["mount", "--make-rslave", str(path / target)], check=True)
        env = json.loads(podman("image", "inspect", "--format", "{{json .Config.Env}}", IMAGE))
        yield Root(path, env)
    finally:
        for target in reversed(mounts):
            subprocess.run(["umount", "-R", "-l", str(target)])
        subprocess.run(["podman", "umount", name], capture_output=True)
        subprocess.run(["podman", "rm", "-f", name], capture_output=True)


def test_check_build_shows_pytorch_gloo_and_mpi_with_setup_sh_pins(root):
    result = root.run("horovodrun --check-build")
    assert result.returncode == 0, result.stderr
    for framework in ("PyTorch", "Gloo", "MPI"):
        assert f"[X] {framework}" in result.stdout, result.stdout
    # The versions inside are the ones scripts/setup.sh pins (the builder stage ran it).
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pins = dict(re.findall(r"\b([A-Za-z][A-Za-z0-9_-]*)==([0-9][0-9.]*)", setup.split("log()")[0]))
    pins["horovod"] = re.search(r"^horovod_version=(\S+)", setup, re.M).group(1)
    query = "import importlib.metadata as m, json; print(json.dumps({n: m.version(n) for n in %r}))" % sorted(pins)
    versions = json.loads(root.run(f"python -c {shlex.quote(query)}").stdout)
    assert {name: v.split("+")[0] for name, v in versions.items()} == pins


def test_two_ranks_train_the_demo_for_an_epoch(root):
    # Without this machine's name in /etc/hosts Horovod's Gloo init would segfault (exit 139, no
    # message); hvdtrain checks first and says what to add.
    root.hosts("127.0.0.1 localhost")
    bare = root.run("horovodrun -np 2 -H localhost:2 --gloo python -m hvdtrain " + " ".join(TINY_DEMO)
                    + " output.dir=/tmp/run-bare")
    output = bare.stdout + bare.stderr
    assert bare.returncode != 0 and "Segmentation fault" not in output
    assert f"add '127.0.1.1 {socket.gethostname()}' to /etc/hosts" in output, output[-3000:]

    root.hosts("127.0.0.1 localhost", f"127.0.1.1 {socket.gethostname()}")
    result = root.run("horovodrun -np 2 -H localhost:2 --gloo python -m hvdtrain " + " ".join(TINY_DEMO)
                      + " output.dir=/tmp/run")
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    records = [json.loads(line) for line in (root.path / "tmp/run/metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    assert [(r["epoch"], r["step"]) for r in train] == [(0, 3)]
    assert "hvdtrain: 2 ranks on 1 host(s) (gloo controller)" in result.stdout + result.stderr
    assert any(r["split"] == "val" for r in records)
    assert (root.path / "tmp/run/checkpoints/last.pt").is_file()


def test_the_images_sshd_config_is_accepted_and_no_host_key_is_baked_in(root):
    assert not list((root.path / "etc/ssh").glob("ssh_host_*"))  # every container makes its own
    result = root.run("ssh-keygen -A && mkdir -p /run/sshd && /usr/sbin/sshd -t -f /etc/ssh/hvdtrain_sshd_config")
    assert result.returncode == 0, result.stderr
    bad = root.run("/usr/sbin/sshd -t -f /etc/ssh/hvdtrain_sshd_config -o NoSuchOption=1")
    assert bad.returncode != 0  # -t really checks


def test_the_image_is_lean_and_keeps_no_ca_or_secret(root):
    # No compilers, sdists, pip caches, apt lists or downloaded packages.
    for tool in ("gcc", "g++", "cc", "c++", "cmake", "make", "nvcc"):
        assert root.run(f"command -v {tool}").returncode != 0, f"{tool} is in the image"
    # (~/.cache/hvdtrain is the demo data the training test generated; pip's cache must not be there.)
    for leftover in ("root/.cache/pip", "opt/hvdtrain/src/.cache", "run/secrets/ca"):
        assert not (root.path / leftover).exists(), leftover
    assert not list((root.path / "opt").rglob("*.whl"))
    assert not list((root.path / "var/lib/apt/lists").glob("*_Packages*"))
    assert not list((root.path / "var/cache/apt/archives").glob("*.deb"))
    assert not list((root.path / "opt").rglob("*.tar.gz"))
    # (/tmp/run* and torch's compile cache /tmp/torchinductor_root come from the training test above.)
    assert not [p for p in (root.path / "tmp").iterdir()
                if p.name != "run" and not p.name.startswith(("run-", "torchinductor_"))]
    # The CA bundle given as a build secret: neither in the history nor in any file outside the venv.
    history = podman("history", "--no-trunc", "--format", "{{.CreatedBy}}", IMAGE)
    assert "BEGIN CERTIFICATE" not in history and "PIP_CERT" not in history
    env = podman("image", "inspect", "--format", "{{json .Config.Env}}", IMAGE)
    assert "CERT" not in env and "/run/secrets" not in env
    certs = re.findall(r"-----BEGIN CERTIFICATE-----\n(.{64})", Path(CA_BUNDLE).read_text())
    proxy_ca = [Path(p).read_text() for p in Path("/usr/local/share/ca-certificates").glob("*.crt")]
    # The certificates only this machine trusts (not Debian's public ones): the proxy's.
    local = [c for c in certs if any(c in text for text in proxy_ca)] or certs[-1:]
    for cert_line in local:
        found = subprocess.run(["grep", "-rlF", "--exclude-dir=venv", "--exclude-dir=proc", "--exclude-dir=sys",
                                "--exclude-dir=dev", cert_line, str(root.path)], capture_output=True, text=True)
        assert found.stdout == "", f"the build's CA certificate is in {found.stdout.split()[:3]}"
