"""What `make test` checks of docker/ without building the image (`make test-image` builds and runs
it: tests/image): the Dockerfile installs through scripts/setup.sh only, and the sshd config it
ships is valid, listens on the fixed port and lets in keys only -- proven by a real sshd."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from .nodes import REPO

DOCKER = REPO / "docker"
SSHD = "/usr/sbin/sshd"


def test_dockerfile_installs_only_through_the_shared_setup_script():
    text = (DOCKER / "Dockerfile").read_text()
    instructions = re.findall(r"^(?!#)(\w+)\s+((?:.*\\\n)*.*)$", text, re.M)
    runs = [body for keyword, body in instructions if keyword == "RUN"]
    assert any("bash scripts/setup.sh" in body for body in runs)
    for body in runs:  # no second install path that CI would not exercise
        assert not re.search(r"pip\d* install|apt-get install|apt install|horovod", body), body
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.M).group(1)
    assert base.startswith("nvidia/cuda:") and "devel" in base  # nvcc + headers for NCCL ops
    assert re.search(r"^FROM \$\{BASE_IMAGE\} AS builder", text, re.M)
    # The builder keeps only the Horovod wheel; the final stage (the same CUDA version without the
    # compilers) makes the venv from it with setup.sh's no-compile mode, so the venv is written once,
    # never copied between stages (tests/image builds and runs it: make test-image).
    runtime = re.search(r"^ARG RUNTIME_IMAGE=(\S+)", text, re.M).group(1)
    assert runtime == base.replace("-devel-", "-runtime-")
    assert re.search(r"^FROM \$\{RUNTIME_IMAGE\}$", text, re.M)
    assert "COPY --from=builder" not in text
    builder_run, runtime_run = [body for body in runs if "bash scripts/setup.sh" in body]
    assert "HVDTRAIN_WHEEL_OUT=/opt/hvdtrain/wheels" in builder_run and 'rm -rf "$HVDTRAIN_VENV"' in builder_run
    assert "--mount=type=bind,from=builder,source=/opt/hvdtrain/wheels" in runtime_run
    assert "HVDTRAIN_NO_COMPILE=1" in runtime_run and "EXTRAS=${HVDTRAIN_EXTRAS}" in runtime_run
    assert all("--mount=type=secret,id=ca" in body for body in runs if "setup.sh" in body)
    port = re.search(r"^Port (\d+)", (DOCKER / "sshd_config").read_text(), re.M).group(1)
    assert f"EXPOSE {port}" in text and f"HVDTRAIN_SSH_PORT={port}" in text
    for copied in re.findall(r"^COPY (docker/\S+)", text, re.M):
        assert (REPO / copied).is_file(), copied
    ignored = (REPO / ".dockerignore").read_text().split()
    assert ".venv" in ignored and ".git" in ignored  # the build context stays small
    subprocess.run(["bash", "-n", str(DOCKER / "entrypoint.sh")], check=True)


@pytest.fixture
def sshd_env(tmp_path):
    if os.geteuid() != 0 or not Path(SSHD).exists():
        pytest.skip("needs root and openssh-server to start the image's sshd config")
    # sshd's privilege separation directory (the package's service creates it at boot); it stays.
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    for name in ("host", "client"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    return tmp_path


def effective(config: Path, host_key: Path, *options: str) -> dict[str, str]:
    result = subprocess.run([SSHD, "-T", "-f", str(config), "-h", str(host_key), *options],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return dict(line.split(" ", 1) for line in result.stdout.splitlines() if " " in line)


def test_image_sshd_config_is_key_only_on_its_fixed_port(sshd_env):
    config = DOCKER / "sshd_config"
    check = subprocess.run([SSHD, "-t", "-f", str(config), "-h", str(sshd_env / "host")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stderr
    values = effective(config, sshd_env / "host")
    assert values["port"] == "12345"
    assert values["passwordauthentication"] == "no"
    assert values["kbdinteractiveauthentication"] == "no"
    assert values["permitemptypasswords"] == "no"
    assert values["pubkeyauthentication"] == "yes"
    assert values["permitrootlogin"] in ("without-password", "prohibit-password")


def test_image_sshd_lets_a_key_in_and_refuses_passwords(sshd_env):
    # The shipped config, moved to a free port on a spare loopback address for the test.
    with socket.socket() as sock:
        sock.bind(("127.0.0.6", 0))
        port = sock.getsockname()[1]
    (sshd_env / "authorized_keys").write_text((sshd_env / "client.pub").read_text())
    log = sshd_env / "sshd.log"
    sshd = subprocess.Popen([SSHD, "-D", "-f", str(DOCKER / "sshd_config"), "-h", str(sshd_env / "host"),
                             "-o", f"Port={port}", "-o", "ListenAddress=127.0.0.6",
                             "-o", f"PidFile={sshd_env / 'sshd.pid'}",
                             "-o", f"AuthorizedKeysFile={sshd_env / 'authorized_keys'}",
                             "-o", "StrictModes=no", "-E", str(log)])
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection(("127.0.0.6", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and sshd.poll() is None, log.read_text()
                time.sleep(0.1)
        client = ["ssh", "-F", "/dev/null", "-p", str(port), "-o", "UserKnownHostsFile=/dev/null",
                  "-o", "StrictHostKeyChecking=no", "-o", "BatchMode=yes", "-o", "LogLevel=ERROR"]
        with_key = subprocess.run(client + ["-i", str(sshd_env / "client"), "root@127.0.0.6", "echo in"],
                                  capture_output=True, text=True, timeout=30)
        assert with_key.returncode == 0 and with_key.stdout == "in\n", with_key.stderr
        password = subprocess.run(client + ["-o", "PubkeyAuthentication=no", "-o",
                                            "PreferredAuthentications=password,keyboard-interactive",
                                            "root@127.0.0.6", "true"], capture_output=True, text=True, timeout=30)
        assert password.returncode == 255
        assert "Permission denied (publickey)" in password.stderr  # keys are the only method offered
    finally:
        sshd.terminate()
        sshd.wait(timeout=10)
