"""Secrets reach ranks started over ssh without showing in any process's arguments.

horovodrun --gloo used to start a remote rank as ``ssh node1 'cd DIR ; env K=V ... python ...'``:
the values sat in the arguments of the local ssh client and of the remote shell for the whole
job. The patched runner sends them, with the command, to a ``/bin/sh -s`` on the ssh session's
standard input. Both nodes are this box, so the probe's scan of ``/proc`` sees both sides.

The second job leaves out ``--network-interfaces``: horovodrun then starts its task function on
each node to find the common interfaces, and that function now reads its settings (which hold the
job's secret key) from standard input too.
"""

from __future__ import annotations

import subprocess

from tests.parallel.test_secrets import SECRETS_PROBE, WATCHED, probe_lines, secret_env

from .nodes import BIN, TwoNodes


def run_probe(nodes: TwoNodes, tmp_path, *options: str) -> list[dict]:
    folder = tmp_path / "probe"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "-H", "node0:1,node1:1", "--gloo", "--disable-cache", *options,
           str(BIN / "python"), str(SECRETS_PROBE), str(folder)]
    result = subprocess.run(cmd, cwd=tmp_path, env={**nodes.env(tmp_path), **secret_env(folder)},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return probe_lines(result.stdout)


def test_ranks_over_ssh_get_secrets_that_no_process_shows(two_nodes, tmp_path):
    before = two_nodes.accepted_logins()
    lines = run_probe(two_nodes, tmp_path, "--network-interfaces", "lo")
    assert [line["rank"] for line in lines] == [0, 1]
    for line in lines:
        assert line["showing"] == [], f"rank {line['rank']}: the secret is in the arguments of {line['showing']}"
        assert line["seen"] == WATCHED and line["multiline_intact"], line
    logins = {host: count - before[host] for host, count in two_nodes.accepted_logins().items()}
    assert logins["node0"] >= 1 and logins["node1"] >= 1, logins  # both ranks really came over ssh


def test_interface_discovery_over_ssh_still_works(two_nodes, tmp_path):
    lines = run_probe(two_nodes, tmp_path)
    assert [(line["rank"], line["showing"]) for line in lines] == [(0, []), (1, [])]
