"""hostfiles/cloud_hosts.py on saved sample outputs of `aws ec2 describe-instances` and
`az vm list-ip-addresses` (tests/unit/cloud_samples, in the CLIs' documented output shapes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "hostfiles" / "cloud_hosts.py"
SAMPLES = Path(__file__).parent / "cloud_samples"
AWS = SAMPLES / "aws-describe-instances.json"
AZURE = SAMPLES / "azure-vm-list-ip-addresses.json"


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, input=stdin)


def test_aws_running_instances_with_their_gpus_as_slots():
    result = run("aws", str(AWS))
    assert result.returncode == 0, result.stderr
    # 2 running g4dn.12xlarge (4 GPUs) and 1 running p4d.24xlarge (8); terminated and stopped are left out.
    assert result.stdout == "10.0.1.11 slots=4\n10.0.1.12 slots=4\n10.0.2.21 slots=8\n"
    assert result.stderr == "cloud_hosts: 3 hosts, 16 slots\n"


def test_aws_hosts_form_and_slots_override():
    assert run("aws", str(AWS), "--format", "hosts", "--slots", "2").stdout == "10.0.1.11:2,10.0.1.12:2,10.0.2.21:2\n"


def test_aws_public_addresses_missing_on_one_instance_is_one_line():
    result = run("aws", str(AWS), "--address", "public")
    assert result.returncode == 2
    assert result.stderr == "cloud_hosts: instance i-0d4e5f60718293a41 has no PublicIpAddress (try --address private)\n"


def test_azure_private_and_public_addresses(tmp_path):
    result = run("azure", str(AZURE), "--slots", "4", "--format", "openmpi")
    assert result.stdout == ("# 2 hosts, 8 slots, from azure azure-vm-list-ip-addresses.json\n"
                             "10.1.0.4 slots=4 max_slots=4\n10.1.0.5 slots=4 max_slots=4\n")
    assert run("azure", "-", "--slots", "1", "--address", "public", "--format", "hosts",
               stdin=AZURE.read_text()).stdout == "20.51.3.17:1,20.51.3.29:1\n"
    # The hostfile is what horovodrun reads: its own parser accepts it.
    from horovod.runner.common.util.hosts import parse_host_files

    hostfile = tmp_path / "hostfile"
    hostfile.write_text(run("aws", str(AWS)).stdout)
    assert parse_host_files(str(hostfile)) == "10.0.1.11:4,10.0.1.12:4,10.0.2.21:8"


@pytest.mark.parametrize("args, message", [
    (["azure", str(AZURE)], "does not say how many GPUs a VM has: pass --slots N"),
    (["azure", str(AWS), "--slots", "4"], "not `az vm list-ip-addresses` JSON"),
    (["aws", str(AZURE)], "not `aws ec2 describe-instances` JSON"),
    (["aws", str(AWS), "--slots", "0"], "--slots must be positive, got 0"),
    (["aws", str(SCRIPT)], "is not JSON ("),
])
def test_wrong_input_is_one_line(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert result.stdout == ""
