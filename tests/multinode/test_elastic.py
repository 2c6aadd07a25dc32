"""Elastic training over the two ssh machines: a worker on node1 is killed and node1 leaves the
discovery list; training goes on with node0 alone, without losing or repeating a sample of the
interrupted epoch; node1 comes back and is added again; every epoch completes, and the learning
rate follows the number of ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import training_processes

from .nodes import BIN, REPO

EPOCHS = 14


class JobLog:
    """The job's whole output in a file (kept for a post-mortem), searched as it grows."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0

    def wait_for(self, text: str, job: subprocess.Popen, timeout: float = 240) -> None:
        """Until ``text`` appears after what earlier calls matched."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            content = self.path.read_text(errors="replace")
            found = content.find(text, self.offset)
            if found >= 0:
                self.offset = found + len(text)
                return
            if job.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"'{text}' never appeared (full output: {self.path}):\n{self.tail()}")

    def tail(self, chars: int = 4000) -> str:
        return self.path.read_text(errors="replace")[-chars:]


def worker_pids(host: str, marker: str) -> list[int]:
    """Training processes started for ``host`` (horovodrun sets HOROVOD_HOSTNAME)."""
    return [pid for pid, environ in training_processes(marker).items() if environ.get("HOROVOD_HOSTNAME") == host]


@pytest.mark.slow
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
    log = JobLog(tmp_path / "horovodrun.log")
    with log.path.open("w") as sink:
        job = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=sink, stderr=subprocess.STDOUT)
    try:
        log.wait_for(f"epoch 1/{EPOCHS} ", job)
        victims = worker_pids("node1", str(run_dir))
        assert len(victims) == 1, victims
        hosts_file.write_text("node0:1\n")
        os.kill(victims[0], signal.SIGKILL)
        log.wait_for("elastic: 1 rank(s)", job)
        log.wait_for("epoch ", job)  # an epoch finishes on node0 alone
        hosts_file.write_text("node0:1\nnode1:1\n")
        log.wait_for("elastic: 2 rank(s)", job)
        job.wait(timeout=400)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the job did not finish (full output: {log.path}):\n{log.tail()}") from None
    finally:
        job.kill()
        job.wait()
        # Workers started over ssh outlive a killed horovodrun: end them, or a failed run keeps
        # two cores busy for the rest of the suite.
        for pid in training_processes(str(run_dir)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert job.returncode == 0, log.tail()
    output = log.tail(6000)

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records if r["split"] == "train"] == list(range(EPOCHS))
    sizes = [r["world_size"] for r in records if r["split"] == "train"]
    assert 1 in sizes and sizes[-1] == 2, (sizes, output)
    # The learning rate follows the number of ranks (linear scaling) after every reset.
    peaks = {int(n): float(lr) for n, lr in re.findall(r"elastic: (\d) rank\(s\).*peak lr ([0-9.e-]+)",
                                                           log.path.read_text(errors="replace"))}
    assert set(peaks) == {1, 2} and peaks[1] == pytest.approx(peaks[2] / 2), peaks
    # Training metrics cover whole epochs, across resets (their sums are committed with the state).
    assert [r["samples"] for r in records if r["split"] == "train"] == [96] * EPOCHS, output

    # Every epoch, the interrupted one included, trained on each of the 96 images exactly once.
    seen: dict[int, list[int]] = {}
    processes = set()
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        entry = json.loads(line)
        seen.setdefault(entry["epoch"], []).extend(entry["indices"])
        processes.add(entry["process"])
    assert sorted(seen) == list(range(EPOCHS))
    for epoch, indices in seen.items():
        assert sorted(indices) == list(range(96)), f"epoch {epoch}: {len(indices)} samples"
    assert len(processes) >= 3, processes  # node0's worker, the lost one, the newcomer
