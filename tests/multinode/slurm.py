"""A one-machine Slurm cluster for the tests: munged, slurmctld and slurmd, all started here.

Nothing outside ``workdir`` is touched: munged gets its own key and socket, Slurm its own
``slurm.conf`` (``SLURM_CONF`` points the client commands at it), free ports, spool and state
directories. One node, named after this host, with every CPU; root runs the daemons
(``SlurmUser=root``) and processes are tracked without cgroups (``proctrack/linuxproc``).

    cluster = SlurmCluster(workdir).start()
    cluster.env()                       environment for sbatch/srun/scontrol (SLURM_CONF=...)
    cluster.sbatch(script, args, cwd)   submit, wait, return (job id, state, output text)
    cluster.stop()
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "scontrol")


def unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the Slurm tests need root (they start slurmctld and slurmd as SlurmUser=root)"
    for tool in DAEMONS:
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            return f"the Slurm tests need {tool} (scripts/test-deps.sh installs slurm-wlm and munge)"
    if (os.cpu_count() or 1) < 2:
        return "the Slurm tests need 2 CPUs (two ranks)"
    return None


def free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


class SlurmCluster:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.node = socket.gethostname().split(".")[0]
        self.conf = workdir / "slurm.conf"
        self.munge_socket = workdir / "munge" / "munge.socket"
        self._processes: list[subprocess.Popen] = []

    def _sbin(self, name: str) -> str:
        return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name

    def start(self) -> "SlurmCluster":
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        munge = self.workdir / "munge"
        for sub in ("munge", "state", "spool", "log"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(munge, 0o700)
        key = munge / "munge.key"
        subprocess.run([self._sbin("mungekey"), "--create", "--keyfile", str(key)], check=True,
                       capture_output=True)
        self._spawn([self._sbin("munged"), "--foreground", "--force", f"--key-file={key}",
                     f"--socket={self.munge_socket}", f"--pid-file={munge / 'munged.pid'}",
                     f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged socket")
        ctld_port, slurmd_port = free_ports(2)
        log = self.workdir / "log"
        self.conf.write_text("\n".join([
            "ClusterName=hvdtrain-test",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also holds a requeued job back (120 s by default): 10 s keeps requeue tests short.
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}",
            f"StateSaveLocation={self.workdir / 'state'}",
            f"SlurmdSpoolDir={self.workdir / 'spool'}",
            f"SlurmctldPidFile={self.workdir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.workdir / 'slurmd.pid'}",
            f"SlurmctldLogFile={log / 'slurmctld.log'}",
            f"SlurmdLogFile={log / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/builtin",
            # The main scheduling pass, which starts a requeued job once its hold is over, comes every
            # 60 s by default: a requeue test waited up to a minute for it. Every 2 s here.
            "SchedulerParameters=sched_interval=2",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]))
        self._spawn([self._sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn([self._sbin("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(self._node_idle, "the Slurm node to become idle", timeout=60)

    def _spawn(self, cmd: list[str]) -> None:
        log = open(self.workdir / "log" / f"{Path(cmd[0]).name}.out", "w")
        self._processes.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                                env=self.env()))

    def _node_idle(self) -> bool:
        result = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env(), capture_output=True, text=True)
        return result.returncode == 0 and result.stdout.strip() == "idle"

    def _wait(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for process in self._processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{process.args[0]} exited {process.returncode}: {self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")

    def logs(self) -> str:
        parts = []
        for path in sorted((self.workdir / "log").glob("*")) + [self.workdir / "munge" / "munged.log"]:
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text()[-1500:]}")
        return "\n".join(parts)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + ":/usr/sbin:/sbin"
        return env

    def sbatch(self, script: Path, args: list[str], cwd: Path, env: dict[str, str],
               sbatch_options: list[str] = (), timeout: float = 600) -> tuple[str, str, str]:
        """Submit ``script args`` from ``cwd``, wait for it; return (job id, final state, output)."""
        output = cwd / "slurm-%j.out"
        submit = subprocess.run(["sbatch", "--parsable", f"--output={output}", *sbatch_options, str(script),
                                 *args], cwd=cwd, env={**env, "SLURM_CONF": str(self.conf)},
                                capture_output=True, text=True, timeout=60)
        if submit.returncode != 0:
            raise AssertionError(f"sbatch failed: {submit.stderr}")
        job = submit.stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            query = subprocess.run(["scontrol", "show", "job", job], env=self.env(), capture_output=True, text=True)
            match = re.search(r"JobState=(\S+)", query.stdout)
            state = match.group(1) if match else state
            if state and state not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
                break
            time.sleep(0.5)
        else:
            subprocess.run(["scancel", job], env=self.env())
            raise AssertionError(f"job {job} still {state} after {timeout}s")
        path = cwd / f"slurm-{job}.out"
        return job, state, path.read_text() if path.exists() else ""

    def stop(self) -> None:
        for process in reversed(self._processes):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()
