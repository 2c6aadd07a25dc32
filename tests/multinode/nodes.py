"""Two "machines" on one box, reachable over real ssh: the ``two_nodes`` test harness.

``TwoNodes.start(workdir)`` gives the suite what a small cluster gives a user:

* ``node0`` and ``node1`` resolve (a marked block in ``/etc/hosts``) to the loopback addresses
  127.0.0.2 and 127.0.0.3; ``node-down`` resolves to 127.0.0.4, where nothing listens.
* One sshd per node, started here with its own config (``-f``), host key, pid file and log
  (``-E``), listening only on that node's address, on a free non-default port, key-only root
  login (no passwords, no PAM).
* A client key and a marked ``Host node0 node1 node-down`` block at the top of ``~/.ssh/config``
  (port, identity file, a known_hosts file that already holds both host keys), so plain
  ``ssh node0`` works for horovodrun, mpirun and ``hvdtrain doctor`` alike, as on a cluster.

Everything changed outside ``workdir`` is restored by ``stop()`` (idempotent; a block left by a
crashed run is removed by the next ``start()``). An exclusive lock serializes sessions that share
the box, since ``node0``/``node1`` and ``~/.ssh/config`` are machine-wide.

API used by the tests (and meant for reuse, e.g. elastic tests that kill a worker on node1):

    nodes.hosts                      ("node0", "node1")
    nodes.addresses                  {"node0": "127.0.0.2", "node1": "127.0.0.3"}
    nodes.unreachable_host           "node-down" (resolves; no sshd)
    nodes.ssh_port, nodes.identity_file, nodes.ssh_config
    nodes.sshd_logs                  {"node0": Path, "node1": Path}
    nodes.accepted_logins()          {"node0": n, "node1": m}  "Accepted publickey" lines so far
    nodes.hostfile(path, slots=1, style="horovod" | "openmpi", hosts=None) -> Path
    nodes.ssh(host, command)         CompletedProcess of ``ssh host command``
    nodes.horovodrun(program, cwd, np=2, hosts="node0:1,node1:1", controller="gloo", extra=())
                                     (hosts=None: no -H, e.g. with --host-discovery-script in extra)
    nodes.mpirun(program, cwd, np=2, hostfile=None, extra=())
    nodes.env(cwd)                   the environment both launchers get (PYTHONPATH=repo, ...)

``program`` is the argv after the interpreter (``["-m", "hvdtrain", ...]`` or a script path).
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import job_env

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HOSTS_FILE = Path("/etc/hosts")
SSH_DIR = Path.home() / ".ssh"
LOCK_FILE = Path("/tmp/hvdtrain-two-nodes.lock")
BEGIN = "# >>> hvdtrain two-nodes test harness (tests/multinode/nodes.py); removed on teardown"
END = "# <<< hvdtrain two-nodes test harness"
ADDRESSES = {"node0": "127.0.0.2", "node1": "127.0.0.3"}
UNREACHABLE = ("node-down", "127.0.0.4")
JOB_TIMEOUT = 600


def unavailable_reason() -> str | None:
    """Why the harness cannot run here, or None."""
    if os.geteuid() != 0:
        return "two-node tests need root (they start sshd and edit /etc/hosts)"
    for tool in ("/usr/sbin/sshd", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"two-node tests need {tool} (apt-get install openssh-server openssh-client)"
    for name, address in [*ADDRESSES.items(), UNREACHABLE]:
        try:
            resolved = socket.gethostbyname(name)
        except OSError:
            continue
        if resolved != address and BEGIN not in HOSTS_FILE.read_text():
            return f"{name} already resolves to {resolved} on this machine; not shadowing a real host"
    return None


def local_addresses() -> set[str]:
    """The IPv4 addresses configured on this machine's interfaces (``ip -o -4 addr``)."""
    try:
        out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return set()
    return {fields[3].split("/")[0] for fields in (line.split() for line in out.splitlines()) if len(fields) > 3}


def check_not_local() -> None:
    """A node address configured on an interface makes horovodrun take that node for this machine
    and start its rank without ssh: the tests would pass without testing the remote path (and the
    ssh login counts fail). Stop with the fix instead."""
    local = sorted(local_addresses() & set(ADDRESSES.values()))
    if local:
        raise RuntimeError(f"{', '.join(local)} is configured on a local interface, so horovodrun would start "
                           f"that node's rank without ssh: remove it (ip addr del {local[0]}/8 dev lo); "
                           f"127.0.0.0/8 is reachable without it")


def strip_block(text: str) -> str:
    """``text`` without a harness block (what the file held before ``start()``)."""
    return re.sub(rf"(?ms)^{re.escape(BEGIN)}\n.*?^{re.escape(END)}\n?", "", text)


def write_in_place(path: Path, text: str) -> None:
    # /etc/hosts is often a bind mount in containers: rewrite the file, never rename over it.
    with open(path, "r+") as handle:
        handle.seek(0)
        handle.write(text)
        handle.truncate()


def free_port(address: str, start: int = 22220) -> int:
    """A port free on ``address`` and on the other node addresses (one port for all nodes)."""
    for port in range(start, start + 200):
        try:
            for host in [*ADDRESSES.values(), UNREACHABLE[1]]:
                with socket.socket() as sock:
                    sock.bind((host, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no free port from {start} on {address}")


class TwoNodes:
    hosts = tuple(ADDRESSES)
    addresses = dict(ADDRESSES)
    unreachable_host = UNREACHABLE[0]

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.identity_file = workdir / "id_ed25519"
        self.known_hosts = workdir / "known_hosts"
        self.ssh_config = SSH_DIR / "config"
        self.sshd_logs = {host: workdir / host / "sshd.log" for host in self.hosts}
        self.ssh_port = 0
        self._processes: dict[str, subprocess.Popen] = {}
        self._lock = None
        self._created_ssh_dir = False
        self._created_ssh_config = False

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, lock_timeout: float = 900) -> "TwoNodes":
        check_not_local()
        self._lock = open(LOCK_FILE, "w")
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{LOCK_FILE} held by another test session for {lock_timeout:.0f}s")
                time.sleep(1)
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        self.ssh_port = free_port(self.addresses["node0"])
        run = subprocess.run
        run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvdtrain-two-nodes", "-f",
             str(self.identity_file)], check=True)
        (self.workdir / "authorized_keys").write_text(Path(f"{self.identity_file}.pub").read_text())
        known = []
        for host, address in self.addresses.items():
            node_dir = self.workdir / host
            node_dir.mkdir()
            key = node_dir / "ssh_host_ed25519_key"
            run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
            known.append(f"[{host}]:{self.ssh_port},[{address}]:{self.ssh_port} "
                         f"{Path(f'{key}.pub').read_text().split(' ')[0]} "
                         f"{Path(f'{key}.pub').read_text().split(' ')[1]}")
            (node_dir / "sshd_config").write_text(self._sshd_config(host, address, key))
        self.known_hosts.write_text("\n".join(known) + "\n")

        # Host names first, so that sshd's and ssh's look-ups already see them.
        original = HOSTS_FILE.read_text()
        (self.workdir / "hosts.orig").write_text(original)
        block = [BEGIN] + [f"{address} {host}" for host, address in self.addresses.items()]
        block += [f"{UNREACHABLE[1]} {UNREACHABLE[0]}", END]
        base = strip_block(original)
        write_in_place(HOSTS_FILE, base + ("" if base.endswith("\n") or not base else "\n") + "\n".join(block) + "\n")

        if not SSH_DIR.exists():
            SSH_DIR.mkdir(mode=0o700)
            self._created_ssh_dir = True
        if self.ssh_config.exists():
            (self.workdir / "ssh_config.orig").write_text(self.ssh_config.read_text())
            existing = strip_block(self.ssh_config.read_text())
        else:
            existing = ""
            self._created_ssh_config = True
        # First match wins in ssh_config: the block goes on top.
        self.ssh_config.write_text(self._client_block() + existing)
        os.chmod(self.ssh_config, 0o600)

        # sshd's privilege separation directory; the package's service creates it at boot. It is
        # left in place (empty, root's): another session's sshd may be using it.
        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
        for host in self.hosts:
            config = self.workdir / host / "sshd_config"
            check = run(["/usr/sbin/sshd", "-t", "-f", str(config)], capture_output=True, text=True)
            if check.returncode != 0:
                raise RuntimeError(f"sshd -t -f {config}: {check.stderr.strip()}")
            self._processes[host] = subprocess.Popen(
                ["/usr/sbin/sshd", "-D", "-f", str(config), "-E", str(self.sshd_logs[host])],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for host, address in self.addresses.items():
            self._wait_listening(host, address)

    def _sshd_config(self, host: str, address: str, key: Path) -> str:
        node_dir = self.workdir / host
        return "\n".join([
            f"# sshd for the test machine {host}: key-only root login on {address}:{self.ssh_port}",
            f"ListenAddress {address}",
            f"Port {self.ssh_port}",
            f"HostKey {key}",
            f"PidFile {node_dir / 'sshd.pid'}",
            f"AuthorizedKeysFile {self.workdir / 'authorized_keys'}",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            # The key files live under /tmp (world-writable parent): StrictModes would refuse them.
            "StrictModes no",
            "LogLevel VERBOSE",
            "MaxStartups 100:30:200",  # horovodrun and mpirun open several sessions at once
            "Subsystem sftp internal-sftp",
            "",
        ])

    def _client_block(self) -> str:
        names = " ".join([*self.hosts, self.unreachable_host])
        return "\n".join([
            BEGIN,
            f"Host {names}",
            "    User root",
            f"    Port {self.ssh_port}",
            f"    IdentityFile {self.identity_file}",
            "    IdentitiesOnly yes",
            f"    UserKnownHostsFile {self.known_hosts}",
            "    StrictHostKeyChecking yes",
            "    BatchMode yes",
            "    ConnectTimeout 10",
            "    LogLevel ERROR",
            END,
            "",
        ])

    def _wait_listening(self, host: str, address: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._processes[host].poll() is not None:
                raise RuntimeError(f"sshd for {host} exited: {self.sshd_logs[host].read_text()[-2000:]}")
            try:
                with socket.create_connection((address, self.ssh_port), timeout=1):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"sshd for {host} not listening on {address}:{self.ssh_port} after {timeout}s")

    def stop(self) -> None:
        """Stop the sshds and restore /etc/hosts and ~/.ssh/config (safe to call twice)."""
        for process in self._processes.values():
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self._processes.clear()
        try:
            text = HOSTS_FILE.read_text()
            if BEGIN in text:
                write_in_place(HOSTS_FILE, strip_block(text))
            if self.ssh_config.exists():
                rest = strip_block(self.ssh_config.read_text())
                if self._created_ssh_config and not rest.strip():
                    self.ssh_config.unlink()
                else:
                    self.ssh_config.write_text(rest)
            if self._created_ssh_dir and SSH_DIR.exists() and not any(SSH_DIR.iterdir()):
                SSH_DIR.rmdir()
        finally:
            if self._lock is not None:
                self._lock.close()  # releases the flock
                self._lock = None

    # --- helpers for tests -----------------------------------------------------------------
    def accepted_logins(self) -> dict[str, int]:
        """How many ssh logins each node's sshd accepted so far (its log's "Accepted publickey")."""
        return {host: log.read_text().count("Accepted publickey for root") if log.exists() else 0
                for host, log in self.sshd_logs.items()}

    def hostfile(self, path: Path, slots: int = 1, style: str = "horovod",
                 hosts: tuple[str, ...] | None = None) -> Path:
        """Write a hostfile: ``host slots=N`` lines (horovodrun and Open MPI read the same form)."""
        if style not in ("horovod", "openmpi"):
            raise ValueError(style)
        lines = [f"# {style} hostfile written by the two-node test harness"]
        lines += [f"{host} slots={slots}" for host in (hosts or self.hosts)]
        path.write_text("\n".join(lines) + "\n")
        return path

    def ssh(self, host: str, command: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(["ssh", host, command], capture_output=True, text=True, timeout=timeout)

    def env(self, cwd: Path) -> dict[str, str]:
        return job_env(cwd)  # the same environment as single-machine jobs (tests/conftest.py)

    def horovodrun(self, program: list[str], cwd: Path, np: int = 2, hosts: str | None = "node0:1,node1:1",
                   controller: str = "gloo", extra: tuple[str, ...] = (), timeout: float = JOB_TIMEOUT,
                   check: bool = True) -> subprocess.CompletedProcess:
        """``horovodrun -np N -H hosts --gloo|--mpi --network-interfaces lo python program``.

        ``hosts=None`` leaves out ``-H`` (elastic runs: pass ``extra=("--host-discovery-script",
        path, "--min-np", "1")`` with a script such as hostfiles/discover-hosts.sh).
        All node addresses live on ``lo``; Horovod would otherwise probe every interface of every
        host for one that routes between them. horovodrun forwards the environment (PYTHONPATH,
        the venv's PATH) to the remote ranks itself.
        """
        cmd = [str(BIN / "horovodrun"), "-np", str(np), *(["-H", hosts] if hosts else []), f"--{controller}",
               "--network-interfaces", "lo", "--disable-cache", *extra, str(BIN / "python"), *program]
        return self._run(cmd, cwd, timeout, check)

    def mpirun(self, program: list[str], cwd: Path, np: int = 2, hostfile: Path | None = None,
               extra: tuple[str, ...] = (), timeout: float = JOB_TIMEOUT,
               check: bool = True) -> subprocess.CompletedProcess:
        """``mpirun -np N --hostfile F -bind-to none -map-by slot -x ... python program``.

        Open MPI starts its daemon on each node over ssh; remote ranks get only the variables
        named with ``-x``, and TCP is pinned to ``lo`` (both for MPI traffic and Open MPI's own).
        """
        hostfile = hostfile or self.hostfile(cwd / "hostfile.openmpi", style="openmpi")
        forwarded = ["PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONUNBUFFERED", "OMP_NUM_THREADS",
                     "HVDTRAIN_CACHE", "OMPI_MCA_btl_vader_single_copy_mechanism"]
        cmd = ["mpirun", "-np", str(np), "--hostfile", str(hostfile), "-bind-to", "none", "-map-by", "slot",
               "-mca", "btl_tcp_if_include", "lo", "-mca", "oob_tcp_if_include", "lo"]
        for name in forwarded:
            cmd += ["-x", name]
        cmd += [*extra, str(BIN / "python"), *program]
        env = self.env(cwd)
        env.setdefault("LD_LIBRARY_PATH", "")
        return self._run(cmd, cwd, timeout, check, env)

    def _run(self, cmd: list[str], cwd: Path, timeout: float, check: bool,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run(cmd, cwd=cwd, env=env or self.env(cwd), capture_output=True, text=True,
                                timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n--- stdout\n"
                                 f"{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}")
        return result
