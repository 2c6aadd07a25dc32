"""Two machines joined by a real, rate-limited link, on one box: the ``net_nodes`` harness.

``NetNodes(workdir).start(rate="250mbit")`` gives what two cluster nodes and their network give:

* Two network namespaces (``hvdtrain-node0``, ``hvdtrain-node1``) joined by a veth pair, whose ends
  are both called ``eth0`` and hold 198.18.0.1 (node0) and 198.18.0.2 (node1): the range set
  aside for network benchmarks (RFC 2544). No address leaves the namespaces, nothing routes out.
* Each end sends through ``tc qdisc ... tbf`` at ``rate``: both directions are limited.
* Each node has its own ``/etc/netns/NAME/hosts`` (``ip netns exec`` mounts it on /etc/hosts), its
  own host name (a UTS namespace) and its own core (taskset), all set on the node's sshd and so
  inherited by everything that runs there: ranks started over ssh and commands run with ``run()``.
* One sshd per node on port 22 of its address, key-only root login, and a ``~/.ssh/config`` of the
  nodes' own (the harness's folder, mounted on ~/.ssh in the nodes' mount namespaces only):
  ``ssh node1`` from node0 works as on a cluster, and so do ``horovodrun -H node0:1,node1:1``,
  ``mpirun`` and ``hvdtrain doctor`` run on node0.
* ``start()`` measures the link with a socket test (a bounded TCP transfer each way) and keeps
  the result beside the rate it set: ``nodes.measured`` (Mbit/s of TCP payload).

``stop()`` restores everything (idempotent; ``stop`` on a fresh object clears what a crashed run
left). A lock keeps two runs apart. Nothing of it is seen outside the namespaces, so the loopback
harness (tests/multinode/nodes.py, the same names on 127.0.0.2/3) runs beside it. Command line,
for benchmarks and by hand:

    python -m tests.multinode.netns start --rate 250mbit [--dir /tmp/hvdtrain-netns]
    python -m tests.multinode.netns run node0 -- hostname     # any command, on node0
    python -m tests.multinode.netns measure | stop
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from . import nodes
from .nodes import SSH_DIR, TwoNodes

ADDRESSES = {"node0": "198.18.0.1", "node1": "198.18.0.2"}
UNREACHABLE = ("node-down", "198.18.0.3")  # in the link's subnet; no one answers there
NAMESPACES = {host: f"hvdtrain-{host}" for host in ADDRESSES}
IFACE = "eth0"
ETC_NETNS = Path("/etc/netns")
DEFAULT_DIR = Path("/tmp/hvdtrain-netns")
LOCK_FILE = Path("/tmp/hvdtrain-netns.lock")
MEASURE_PORT = 46000
# The socket test: node1 receives for at most SECONDS what node0 sends, and prints Mbit/s.
RECEIVER = r"""
import socket, sys, time, json
srv = socket.create_server((sys.argv[1], int(sys.argv[2])))
srv.settimeout(30)
print("listening", flush=True)
conn, _ = srv.accept()
conn.settimeout(30)
total, first = 0, None
while True:
    data = conn.recv(1 << 20)
    if not data:
        break
    if first is None:
        first = time.monotonic()
    total += len(data)
seconds = time.monotonic() - first
print(json.dumps({"bytes": total, "seconds": seconds, "mbit": total * 8 / seconds / 1e6}), flush=True)
"""
SENDER = r"""
import socket, sys, time
sock = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=30)
chunk, end = b"\0" * (1 << 20), time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    sock.sendall(chunk)
sock.shutdown(socket.SHUT_WR)
sock.recv(1)
"""


def run_cmd(cmd: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable_reason() -> str | None:
    """Why the harness cannot run here, or None."""
    if os.geteuid() != 0:
        return "the netns two-node harness needs root (network namespaces, tc, sshd)"
    for tool in ("ip", "tc", "unshare", "nsenter", "taskset", "/usr/sbin/sshd", "ssh", "ssh-keygen"):
        if not shutil.which(tool):
            return f"the netns two-node harness needs {tool} (apt-get install iproute2 util-linux openssh-server)"
    probe = "hvdtrain-probe"
    if run_cmd(["ip", "netns", "add", probe], check=False).returncode != 0:
        return "the netns two-node harness needs `ip netns` (network namespaces): `ip netns add` failed here"
    try:
        run_cmd(["ip", "-n", probe, "link", "set", "lo", "up"], check=False)
        tbf = run_cmd(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "100mbit",
                       "burst", "32kb", "latency", "50ms"], check=False)
        if tbf.returncode != 0:
            return f"the netns two-node harness needs tc's tbf qdisc (sch_tbf): {tbf.stderr.strip()}"
    finally:
        run_cmd(["ip", "netns", "del", probe], check=False)
    return None


def rate_bits(rate: str) -> float:
    """Bits per second of a rate written as tc writes it (250mbit, 1gbit, 10mbps)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)(bit|bps)", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r}: give it as tc does, e.g. 250mbit or 1gbit")
    return float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match[2]] * (8 if match[3] == "bps" else 1)


def burst_for(rate: str) -> str:
    """A tbf bucket of 4 ms of traffic, at least 64 KiB: smaller ones hold a fast link below its rate."""
    return f"{max(64 * 1024, int(rate_bits(rate) / 8 * 0.004))}b"


class NetNodes(TwoNodes):
    hosts = tuple(ADDRESSES)
    addresses = dict(ADDRESSES)
    unreachable_host = UNREACHABLE[0]
    iface = IFACE

    def __init__(self, workdir: Path = DEFAULT_DIR) -> None:
        super().__init__(workdir)
        self.ssh_port = 22  # each sshd has its node's port 22 to itself
        self.state_file = workdir / "state.json"
        self.state: dict = json.loads(self.state_file.read_text()) if self.state_file.exists() else {}
        self.measured: dict[str, float] = self.state.get("measured", {})

    # --- lifecycle -------------------------------------------------------------------------
    def start(self, rate: str | None = "250mbit", hosts_extra: dict[str, list[str]] | None = None,
              lock_timeout: float = 900, hold: bool = False) -> "NetNodes":
        """Set up both nodes and measure the link. ``rate`` None: no tbf (the veth's own speed).
        ``hosts_extra`` adds lines on top of a node's hosts file (they win: first match), e.g.
        ``{"node1": ["127.0.1.1 node1"]}``. ``hold``: the lock outlives this process (the CLI)."""
        lock = open(LOCK_FILE, "w")
        deadline = time.monotonic() + lock_timeout
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{LOCK_FILE} held by another two-node session for {lock_timeout:.0f}s "
                                       f"(a harness left started: python -m tests.multinode.netns stop)")
                time.sleep(1)
        self._lock = lock
        try:
            self.clear()
            self.state = {"rate": rate, "created_etc_netns": not ETC_NETNS.exists()}
            if hold:  # a process of its own keeps the lock until stop()
                holder = subprocess.Popen(["sleep", "infinity"], pass_fds=[lock.fileno()], start_new_session=True,
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
                self.state["holder"] = holder.pid
            self._start_nodes(rate, hosts_extra or {})
            self.measured = self.measure()
            self.state["measured"] = self.measured
            self._save()
        except BaseException:
            self.stop()
            raise
        return self

    def _save(self) -> None:
        self.state_file.write_text(json.dumps(self.state, indent=1) + "\n")

    def _start_nodes(self, rate: str | None, hosts_extra: dict[str, list[str]]) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        pair = [f"hvdtrain-v{i}" for i in range(2)]
        for ns in NAMESPACES.values():
            run_cmd(["ip", "netns", "add", ns])
        run_cmd(["ip", "link", "add", pair[0], "type", "veth", "peer", "name", pair[1]])
        cores = sorted(os.sched_getaffinity(0))
        self.state["cores"] = {}
        for i, (host, ns) in enumerate(NAMESPACES.items()):
            run_cmd(["ip", "link", "set", pair[i], "netns", ns])
            run_cmd(["ip", "-n", ns, "link", "set", pair[i], "name", IFACE])
            run_cmd(["ip", "-n", ns, "addr", "add", f"{ADDRESSES[host]}/24", "dev", IFACE])
            run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])
            run_cmd(["ip", "-n", ns, "link", "set", IFACE, "up"])
            if rate:
                run_cmd(["tc", "-n", ns, "qdisc", "replace", "dev", IFACE, "root", "tbf", "rate", rate,
                         "burst", burst_for(rate), "latency", "50ms"])
            self.state["cores"][host] = cores[i % len(cores)]
            etc = ETC_NETNS / ns
            etc.mkdir(parents=True, exist_ok=True)
            lines = [*hosts_extra.get(host, []), "127.0.0.1 localhost", "::1 localhost ip6-localhost",
                     *(f"{address} {name}" for name, address in ADDRESSES.items()), " ".join(UNREACHABLE[::-1])]
            (etc / "hosts").write_text(f"# {host}'s hosts file (tests/multinode/netns.py)\n" + "\n".join(lines) + "\n")
            (etc / "hostname").write_text(f"{host}\n")

        run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvdtrain-netns", "-f", str(self.identity_file)])
        (self.workdir / "authorized_keys").write_text(Path(f"{self.identity_file}.pub").read_text())
        known = []
        for host, address in ADDRESSES.items():
            node_dir = self.workdir / host
            node_dir.mkdir()
            key = node_dir / "ssh_host_ed25519_key"
            run_cmd(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)])
            kind, text = Path(f"{key}.pub").read_text().split(" ")[:2]
            known.append(f"{host},{address} {kind} {text}")
            (node_dir / "sshd_config").write_text(self._sshd_config(host, address, key))
        self.known_hosts.write_text("\n".join(known) + "\n")
        self._write_ssh_config()

        Path("/run/sshd").mkdir(mode=0o755, parents=True, exist_ok=True)
        self.state["sshd"] = {}
        for host, ns in NAMESPACES.items():
            config = self.workdir / host / "sshd_config"
            run_cmd(["/usr/sbin/sshd", "-t", "-f", str(config)])
            # ip netns exec: the node's network, its /etc/netns files and a mount namespace (its
            # ~/.ssh); unshare --uts: its name; taskset: its core. sshd -D stays this process.
            cmd = ["ip", "netns", "exec", ns, "unshare", "--uts", "taskset", "-c", str(self.state["cores"][host]),
                   "sh", "-c", f'mount --bind "$2" "$3" && hostname {host} && exec /usr/sbin/sshd -D -f "$0" -E "$1"',
                   str(config), str(self.sshd_logs[host]), str(self.workdir / "ssh_home"), str(SSH_DIR)]
            process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL, start_new_session=True)
            self._processes[host] = process
            self.state["sshd"][host] = process.pid
        self._save()
        for host, address in ADDRESSES.items():
            self._wait_log(host, f"Server listening on {address} port 22")

    def _write_ssh_config(self) -> None:
        """The nodes' own ``~/.ssh``: a folder of the harness, mounted on ~/.ssh in each node's mount
        namespace only, so the machine's ~/.ssh (and the loopback harness's block in it) is untouched
        there and unseen here."""
        if not SSH_DIR.exists():  # the mount point; removed again by stop() if still empty
            SSH_DIR.mkdir(mode=0o700)
            self.state["created_ssh_dir"] = True
        home = self.workdir / "ssh_home"
        home.mkdir(mode=0o700, exist_ok=True)
        (home / "config").write_text(self._client_block())
        os.chmod(home / "config", 0o600)

    def _wait_log(self, host: str, line: str, timeout: float = 20) -> None:
        deadline = time.monotonic() + timeout
        log = self.sshd_logs[host]
        while time.monotonic() < deadline:
            if log.exists() and line in log.read_text():
                return
            if self._processes[host].poll() is not None:
                raise RuntimeError(f"sshd for {host} exited: {log.read_text()[-2000:] if log.exists() else ''}")
            time.sleep(0.05)
        raise RuntimeError(f"sshd for {host}: no '{line}' in {log} after {timeout}s")

    def clear(self) -> None:
        """Remove what a harness (this one, or one that crashed) set up; leaves the lock alone."""
        for pid in [*self.state.get("sshd", {}).values()]:
            _kill(pid)
        for process in self._processes.values():
            if process.poll() is None:
                process.kill()
            process.wait()
        self._processes.clear()
        present = run_cmd(["ip", "netns", "list"], check=False).stdout
        for ns in NAMESPACES.values():
            if re.search(rf"^{re.escape(ns)}\b", present, re.M):
                # Every process in the node's namespace was started there by a harness: its sshd and
                # what ran over it. Named by their ids, then the namespace (with its veth end) goes.
                for pid in run_cmd(["ip", "netns", "pids", ns], check=False).stdout.split():
                    _kill(int(pid))
                run_cmd(["ip", "netns", "del", ns], check=False)
            shutil.rmtree(ETC_NETNS / ns, ignore_errors=True)
        for name in ("hvdtrain-v0", "hvdtrain-v1"):
            run_cmd(["ip", "link", "del", name], check=False)
        if self.state.get("created_etc_netns") and ETC_NETNS.is_dir() and not any(ETC_NETNS.iterdir()):
            ETC_NETNS.rmdir()
        if self.state.get("created_ssh_dir") and SSH_DIR.exists() and not any(SSH_DIR.iterdir()):
            SSH_DIR.rmdir()

    def stop(self) -> None:
        """Stop both nodes, remove the namespaces, link and files, release the lock (safe twice)."""
        try:
            self.clear()
        finally:
            if self.state.get("holder"):
                _kill(self.state["holder"])
            self.state = {}
            self.state_file.unlink(missing_ok=True)
            if self._lock is not None:
                self._lock.close()
                self._lock = None

    # --- running things on a node ------------------------------------------------------------
    def prefix(self, host: str, cwd: Path | None = None) -> list[str]:
        """argv prefix that runs a command on ``host``: its network, hosts file, name and core."""
        pid = self.state["sshd"][host]
        return ["nsenter", "-t", str(pid), "-n", "-m", "-u", f"--wd={cwd or Path.cwd()}",
                "taskset", "-c", str(self.state["cores"][host])]

    def run(self, host: str, cmd: list[str], cwd: Path | None = None, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", nodes.JOB_TIMEOUT)
        return subprocess.run(self.prefix(host, cwd) + cmd, cwd=cwd, **kwargs)

    def ssh(self, host: str, command: str, timeout: float = 60, origin: str = "node0") -> subprocess.CompletedProcess:
        return self.run(origin, ["ssh", host, command], timeout=timeout)

    def set_link(self, up: bool, host: str = "node1") -> None:
        """Pull (or plug back) the cable: ``ip link set eth0 down|up`` on ``host``'s end."""
        run_cmd(["ip", "-n", NAMESPACES[host], "link", "set", IFACE, "up" if up else "down"])

    @contextlib.contextmanager
    def hosts_lines(self, host: str, lines: list[str]) -> Iterator[None]:
        """``lines`` on top of ``host``'s hosts file (first match wins) for the block's duration. The
        file is rewritten in place: the node's mount of it is a bind mount of this very file."""
        path = ETC_NETNS / NAMESPACES[host] / "hosts"
        original = path.read_text()
        nodes.write_in_place(path, "\n".join(lines) + "\n" + original)
        try:
            yield
        finally:
            nodes.write_in_place(path, original)

    def measure(self, seconds: float = 1.0, tries: int = 3) -> dict[str, float]:
        """TCP payload Mbit/s each way: the best of ``tries`` bounded transfers of ``seconds`` each (a
        socket test). Both ends run on their node's core, which other work may share: a busy core
        only ever lowers a try, so the best one is the link's."""
        result = {}
        for sender, receiver in (("node0", "node1"), ("node1", "node0")):
            result[f"{sender}->{receiver}"] = max(self._transfer(sender, receiver, seconds) for _ in range(tries))
        return result

    def _transfer(self, sender: str, receiver: str, seconds: float) -> float:
        server = subprocess.Popen(self.prefix(receiver, self.workdir) + [sys.executable, "-c", RECEIVER,
                                  ADDRESSES[receiver], str(MEASURE_PORT)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "listening", "the socket test's receiver did not start"
            self.run(sender, [sys.executable, "-c", SENDER, ADDRESSES[receiver], str(MEASURE_PORT), str(seconds)],
                     cwd=self.workdir, timeout=seconds + 30, check=True)
            return round(json.loads(server.stdout.readline())["mbit"], 1)
        finally:
            server.kill()
            server.wait()

    def horovodrun_argv(self, program: list[str], np: int = 2, hosts: str | None = "node0:1,node1:1",
                        controller: str = "gloo", extra: tuple[str, ...] = (), launch: bool = False) -> list[str]:
        """``horovodrun ... python program``, its ranks on the link's ``eth0`` (run it on node0);
        ``launch``: ``python -m hvdtrain launch`` (horovodrun returning the ranks' exit code)."""
        python = str(nodes.BIN / "python")
        launcher = [python, "-m", "hvdtrain", "launch"] if launch else [str(nodes.BIN / "horovodrun")]
        return [*launcher, "-np", str(np), *(["-H", hosts] if hosts else []), f"--{controller}",
                "--network-interfaces", IFACE, "--disable-cache", *extra, str(nodes.BIN / "python"), *program]

    def horovodrun(self, program: list[str], cwd: Path, np: int = 2, hosts: str | None = "node0:1,node1:1",
                   controller: str = "gloo", extra: tuple[str, ...] = (), timeout: float = nodes.JOB_TIMEOUT,
                   check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """``horovodrun`` started on node0, as a user does there (``program``: argv after python)."""
        cmd = self.prefix("node0", cwd) + self.horovodrun_argv(program, np, hosts, controller, extra)
        return self._run(cmd, cwd, timeout, check, {**self.env(cwd), **(env or {})})


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.multinode.netns", description=__doc__.split("\n")[0])
    parser.add_argument("action", choices=["start", "stop", "measure", "run", "status"])
    parser.add_argument("host", nargs="?", choices=list(ADDRESSES), help="run: the node to run on")
    parser.add_argument("--rate", default="250mbit", help="tbf rate on each end (tc's units; 0: unlimited)")
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the harness's folder (keys, logs, state)")
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    harness = NetNodes(args.dir)
    if args.action == "start":
        reason = unavailable_reason()
        if reason:
            print(f"netns: cannot start: {reason}", file=sys.stderr)
            return 2
        if args.dir.exists():
            harness.stop()
            shutil.rmtree(args.dir)
        harness = NetNodes(args.dir)
        harness.start(None if args.rate in ("0", "none") else args.rate, hold=True)
    elif args.action == "stop":
        harness.stop()
        print("netns: stopped")
        return 0
    if not harness.state.get("sshd"):
        print(f"netns: not started (python -m tests.multinode.netns start --dir {args.dir})", file=sys.stderr)
        return 2
    if args.action == "measure":
        harness.state["measured"] = harness.measure()
        harness._save()
    if args.action == "run":
        if not args.host or not command:
            parser.error("run needs a node and a command: run node0 -- hostname")
        return subprocess.run(harness.prefix(args.host) + command).returncode
    print(json.dumps({"rate": harness.state["rate"], "measured_mbit": harness.state["measured"],
                      "addresses": ADDRESSES, "cores": harness.state["cores"], "dir": str(args.dir)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
