"""A host whose own name does not resolve: Horovod's Gloo init would die with a segfault (exit 139,
no message); hvdtrain stops first with one line. The name is changed for real, in a UTS namespace."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.helpers import BIN, job_env, tiny

NAME = "hvdtrain-unresolvable-host"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare")
def test_unresolvable_hostname_is_one_line_not_a_segfault(tiny_data, tmp_path):
    launch = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", str(BIN / "python"), "-m",
              "hvdtrain"] + tiny(tiny_data, tmp_path / "run", "train.epochs=1")
    script = f"hostname {NAME} && exec " + " ".join(launch)
    result = subprocess.run(["unshare", "--uts", "sh", "-c", script], cwd=tmp_path, env=job_env(tmp_path),
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert (f"hvdtrain: error: this host's name '{NAME}' does not resolve (Horovod's Gloo controller would "
            f"crash with a segfault): add '127.0.1.1 {NAME}' to /etc/hosts or fix DNS") in output
    assert "Exit code: 139" not in output and "exit code: 139" not in output.lower()
