"""A two-node Ray cluster on this machine for tests/parallel/test_ray.py: a head on 127.0.0.2 and a
worker on 127.0.0.3 (Linux routes all of 127.0.0.0/8 to the loopback device), each started with
``ray start`` in its own process group and temp dir, each advertising 1 CPU and one ``hvd_slot``
so that a rank with ``--resource hvd_slot=1`` lands on each node.

Every port Ray opens is set explicitly inside 26000-26999 (the range this test may use), and the
teardown kills the two process groups this module started, never ``ray stop`` (which would end
every Ray on the machine).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from tests.helpers import BIN, job_env

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
GCS_PORT = 26100
DASHBOARD_PORT = 26104
RENDEZVOUS_PORT = 26400
ADDRESS = f"{HEAD_IP}:{GCS_PORT}"
START_SECONDS = 150  # `ray start` takes 10-30 s on an idle 2-core machine, minutes under load


def node_ports(base: int, workers: int) -> list[str]:
    """Every listening port of one node, from ``base`` up; Ray's worker processes in ``workers``-+99."""
    return ["--node-manager-port", str(base + 1), "--object-manager-port", str(base + 2),
            "--dashboard-agent-listen-port", str(base + 5), "--dashboard-agent-grpc-port", str(base + 6),
            "--runtime-env-agent-port", str(base + 7), "--metrics-export-port", str(base + 8),
            "--min-worker-port", str(workers), "--max-worker-port", str(workers + 99)]


def can_bind(ip: str) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


class RayCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        # Ray's sockets live in its temp dir, and a Unix socket's path is at most 107 bytes: pytest's
        # tmp_path under a pytest-xdist worker (/tmp/pytest-of-root/pytest-N/popen-gw1/...) is too long.
        self.temp_root = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.groups: list[int] = []
        self.env = job_env(root)
        self.env.update({
            "RAY_USAGE_STATS_ENABLED": "0",
            # The autoscaler's and the dashboard's metrics ports are fixed (44217, 44227) unless set.
            "AUTOSCALER_METRIC_PORT": "26109", "DASHBOARD_METRIC_PORT": "26110",
            # On a loaded machine the dashboard agent takes longer than the raylet's default wait for
            # it to start (the raylet then aborts the node start).
            "RAY_agent_register_timeout_ms": "180000", "RAY_raylet_start_wait_time_s": "180",
        })

    def ray_start(self, name: str, args: list[str], base: int, attempts: int = 2) -> None:
        """``ray start`` for one node (its ports from ``base``), retried once."""
        for attempt in range(attempts):
            temp = self.temp_root / f"{name}-{attempt}"
            node_id = secrets.token_hex(28)
            common = ["--num-cpus", "1", "--resources", json.dumps({"hvd_slot": 1}), "--object-store-memory",
                      "100000000", "--temp-dir", str(temp), "--disable-usage-stats"]
            log_path = self.root / f"{name}-{attempt}.log"
            announcer = threading.Thread(target=announce_agent_ports, args=(temp, node_id, base), daemon=True)
            announcer.start()
            with open(log_path, "w") as log:
                # The daemons `ray start` leaves behind stay in this new process group: the teardown's handle.
                start = subprocess.Popen([str(BIN / "ray"), "start", *args, *common], cwd=self.root,
                                         env={**self.env, "RAY_OVERRIDE_NODE_ID_FOR_TESTING": node_id},
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.groups.append(start.pid)
            try:
                if start.wait(timeout=START_SECONDS) == 0:
                    return
            except subprocess.TimeoutExpired:
                pass
            kill_groups([start.pid])
        raise RuntimeError(f"ray start ({name}) failed {attempts} times:\n{log_path.read_text()[-3000:]}")

    def start(self) -> None:
        self.ray_start("head", ["--head", f"--node-ip-address={HEAD_IP}", "--port", str(GCS_PORT),
                                "--ray-client-server-port", str(GCS_PORT + 3), "--include-dashboard=true",
                                "--dashboard-host", HEAD_IP, "--dashboard-port", str(DASHBOARD_PORT),
                                *node_ports(GCS_PORT, 26200)], GCS_PORT)
        self.ray_start("worker", ["--address", ADDRESS, f"--node-ip-address={WORKER_IP}",
                                  *node_ports(GCS_PORT + 10, 26300)], GCS_PORT + 10)
        self.wait_for_nodes(2)

    def wait_for_nodes(self, count: int) -> None:
        from ray.util.state import list_nodes

        deadline, alive = time.monotonic() + START_SECONDS, []
        while time.monotonic() < deadline:
            try:
                alive = [n for n in list_nodes(address=ADDRESS, timeout=30) if n.state == "ALIVE"]
            except Exception:  # the dashboard's API server may still be starting
                alive = []
            if len(alive) >= count:
                return
            time.sleep(2)
        raise RuntimeError(f"only {len(alive)} of {count} Ray nodes came up")

    def stop(self) -> None:
        kill_groups(self.groups)
        shutil.rmtree(self.temp_root, ignore_errors=True)


def announce_agent_ports(temp: Path, node_id: str, base: int) -> None:
    """Write the agent port files the raylet waits for, as soon as the node's session folder exists.

    The raylet gives its dashboard agent a fixed 15 s (Ray 2.60) to write its listen port into the
    session folder and aborts the node otherwise; on a machine loaded by other work the agent's
    imports alone take longer. The ports are fixed here (node_ports), so the files can be written
    for it with the same numbers the agent writes itself later; the node id is fixed for that
    (RAY_OVERRIDE_NODE_ID_FOR_TESTING)."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        sessions = [p for p in temp.glob("session_2*") if p.is_dir()] if temp.is_dir() else []
        if sessions:
            for name, port in (("dashboard_agent_listen_port", base + 5), ("metrics_agent_port", base + 6),
                               ("runtime_env_agent_port", base + 7)):
                path = sessions[0] / f"{name}_{node_id}"
                if not path.exists():
                    partial = path.with_suffix(".announce")
                    partial.write_text(str(port))
                    partial.rename(path)
            return
        time.sleep(0.05)


def kill_groups(groups: list[int]) -> None:
    """SIGTERM to each process group, SIGKILL to what is left 15 s later."""
    for signum in (signal.SIGTERM, signal.SIGKILL):
        for group in groups:
            try:
                os.killpg(group, signum)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 15
        while signum == signal.SIGTERM and time.monotonic() < deadline and any(map(alive, groups)):
            time.sleep(0.5)


def alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True
