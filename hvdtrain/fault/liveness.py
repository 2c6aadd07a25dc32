"""The liveness service every rank runs, and the check that names the lost rank.

A rank killed outright is noticed by the launcher (horovodrun, mpirun and srun end the job when a
process exits). A rank that hangs, or a node that drops off the network, is not: the others wait
in a collective forever (MPI has no timeout; Gloo gives up after ``HOROVOD_GLOO_TIMEOUT_SECONDS``
without saying which peer it waited for). So every rank runs a tiny TCP service that answers
"alive" from its own thread, whose address every rank knows; it listens on the address the ranks
use (not every interface), serves every connection at once (silent clients cannot delay an answer)
and answers only pings that prove the rank's token.

When a rank gives up (the progress watchdog, fault/watchdog.py, or a collective that failed,
train/stops.py), it asks every peer's service whether it is alive (``lost_message``) and prints
one line naming the ranks (and hosts, and process ids) that did not answer.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, cast

from ..comm import launcher_env as launcher

PING, PONG = b"hvdtrain-ping ", b"hvdtrain-alive "
MAX_LINE = 256
# How long the service keeps a connection that has not sent a whole ping, and how many such
# connections it keeps at once (beyond that the oldest goes): silent or slow clients cost a socket
# each, never the answer to another ping.
CONNECTION_SECONDS = 5.0
MAX_CONNECTIONS = 256


@dataclass
class Peer:
    rank: int
    host: str
    addresses: list[str]
    port: int
    pid: int
    token: str = field(default="", repr=False)  # hex; the secret this rank's service answers to

    def label(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


def proof(token: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of the parts, hex: shows knowledge of the token without sending it."""
    return hmac.new(token, b"|".join(parts), hashlib.sha256).hexdigest().encode()


# --- where the service listens ---------------------------------------------------------------------

def _resolve(name: str | None) -> list[str]:
    if not name:
        return []
    try:
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    ipv4 = [str(info[4][0]) for info in found if info[0] == socket.AF_INET]
    return list(dict.fromkeys(ipv4 + [str(info[4][0]) for info in found if info[0] == socket.AF_INET6]))


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        return False


def _interface_addresses(env: Mapping[str, str], interfaces: Mapping[str, list[str]]) -> list[str]:
    """Addresses of the network the launcher told the ranks to use: horovodrun's and hvdtrain ray's
    HOROVOD_GLOO_IFACE, mpirun's btl_tcp_if_include (names or CIDR blocks), NCCL_SOCKET_IFNAME
    (name prefixes; '=' exact names; a '^' exclusion list says nothing)."""
    gloo = env.get("HOROVOD_GLOO_IFACE", "")
    if gloo:
        return list(interfaces.get(gloo, []))
    found: list[str] = []
    for item in filter(None, env.get("OMPI_MCA_btl_tcp_if_include", "").split(",")):
        if "/" in item:
            try:
                network = ipaddress.ip_network(item, strict=False)
            except ValueError:
                continue
            found += [a for addresses in interfaces.values() for a in addresses
                      if _in_network(a, network)]
        else:
            found += interfaces.get(item, [])
    nccl = env.get("NCCL_SOCKET_IFNAME", "")
    if not found and nccl and not nccl.startswith("^"):
        exact = nccl.startswith("=")
        for item in filter(None, nccl.lstrip("=").split(",")):
            found += [a for name, addresses in sorted(interfaces.items())
                      if (name == item if exact else name.startswith(item)) for a in addresses]
    return list(dict.fromkeys(found))


def _in_network(address: str, network: ipaddress.IPv4Network | ipaddress.IPv6Network) -> bool:
    try:
        return ipaddress.ip_address(address) in network
    except ValueError:
        return False


def host_interfaces() -> dict[str, list[str]]:
    """Interface name -> its addresses, IPv4 first."""
    import psutil

    table: dict[str, list[str]] = {}
    for name, addresses in psutil.net_if_addrs().items():
        ipv4 = [a.address for a in addresses if a.family == socket.AF_INET]
        ipv6 = [a.address for a in addresses if a.family == socket.AF_INET6]
        table[name] = ipv4 + ipv6
    return table


def _default_route_address() -> list[str]:
    """The source address of this host's default route (no packet is sent); [] without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("192.0.2.1", 9))  # TEST-NET-1: routed by the default route, never reached
            return [probe.getsockname()[0]]
    except OSError:
        return []


def listen_addresses(env: Mapping[str, str] | None = None, one_host: bool = False,
                     interfaces: Mapping[str, list[str]] | None = None) -> list[str]:
    """Where the liveness service should listen, best first: the address the other ranks reach
    this one at, never every interface.

    1. The network the launcher named (HOROVOD_GLOO_IFACE, mpirun's btl_tcp_if_include,
       NCCL_SOCKET_IFNAME), preferring the address the launcher's host name (HOROVOD_HOSTNAME)
       resolves to on it: the loopback aliases 127.0.0.2/3 that stand for node0/node1 on lo.
    2. Every rank on this host: loopback.
    3. Several hosts and no network named (plain mpirun, srun): this host's own name's address,
       then the default route's, never a loopback one, which the other hosts could not reach.
    The service binds the first it can; with none, every interface (the token still guards it).
    """
    env = os.environ if env is None else env
    interfaces = host_interfaces() if interfaces is None else interfaces
    named = _resolve(env.get("HOROVOD_HOSTNAME"))
    on_network = _interface_addresses(env, interfaces)
    if on_network:
        loopback_network = any(_loopback(a) for a in on_network)
        preferred = [a for a in named if a in on_network or (loopback_network and _loopback(a))]
        return list(dict.fromkeys(preferred + on_network))
    if one_host:
        return ["127.0.0.1"]
    outward = named + _resolve(socket.gethostname()) + _default_route_address()
    return list(dict.fromkeys(a for a in outward if not _loopback(a)))


def _listen(addresses: list[str]) -> tuple[socket.socket, str]:
    for address in addresses:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            return socket.create_server((address, 0), family=family, backlog=64), address
        except OSError:  # not an address of this host after all, or an IPv6 one without its scope
            continue
    return socket.create_server(("", 0), backlog=64), ""


class LivenessService:
    """Answers pings from other ranks, from a daemon thread (it keeps answering while the main
    thread is stuck in a collective, but not when the process is stopped or gone).

    It listens on one address (``listen_addresses``), serves every connection at once (one
    selector loop: a silent or slow client holds a socket, not the answer to the next ping), and
    answers only a ping that proves it knows this rank's token, with a reply that proves the same;
    anything else is closed unanswered. The token is random per process and reaches the other
    ranks with the address, through the collective that gathers them (``build_peers``)."""

    def __init__(self, rank: int, addresses: list[str] | None = None):
        self.rank = rank
        self.token = secrets.token_bytes(32)
        self.server, self.address = _listen(listen_addresses() if addresses is None else addresses)
        self.port = self.server.getsockname()[1]
        self.closed = False
        self.server.setblocking(False)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.server, selectors.EVENT_READ)
        threading.Thread(target=self._serve, name="hvdtrain-liveness", daemon=True).start()

    def answer(self, line: bytes) -> bytes | None:
        """The reply to one request line, or None when it does not prove the token."""
        if not line.startswith(PING):
            return None
        nonce, _, claimed = line[len(PING):].strip().partition(b" ")
        if not nonce or len(nonce) > 64 or not hmac.compare_digest(claimed, proof(self.token, b"ping", nonce)):
            return None
        rank = str(self.rank).encode()
        return PONG + rank + b" " + proof(self.token, b"alive", nonce, rank) + b"\n"

    def _serve(self) -> None:
        selector = self.selector
        pending: dict[socket.socket, tuple[float, bytearray]] = {}  # insertion order: oldest first

        def drop(conn: socket.socket) -> None:
            pending.pop(conn, None)
            try:
                selector.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()

        while not self.closed:
            now = time.monotonic()
            for conn in [c for c, (deadline, _) in pending.items() if deadline <= now]:
                drop(conn)
            wait = min([deadline for deadline, _ in pending.values()] + [now + 0.5]) - now
            try:
                events = selector.select(max(0.0, wait))
            except OSError:
                return
            for key, _ in events:
                if key.fileobj is self.server:
                    try:
                        conn, _ = self.server.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    except OSError:
                        if self.closed:
                            return
                        continue
                    conn.setblocking(False)
                    if len(pending) >= MAX_CONNECTIONS:
                        drop(next(iter(pending)))
                    pending[conn] = (time.monotonic() + CONNECTION_SECONDS, bytearray())
                    selector.register(conn, selectors.EVENT_READ)
                    continue
                conn = cast(socket.socket, key.fileobj)  # every registered object but the server is one
                try:
                    data = conn.recv(MAX_LINE)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                buffer = pending[conn][1]
                buffer += data
                if data and b"\n" not in buffer and len(buffer) < MAX_LINE:
                    continue
                reply = self.answer(bytes(buffer).split(b"\n", 1)[0]) if data else None
                if reply is not None:
                    try:
                        conn.send(reply)  # a few dozen bytes into an empty socket buffer: never blocks
                    except OSError:
                        pass
                drop(conn)
        for conn in list(pending):
            drop(conn)
        selector.close()

    def close(self) -> None:
        self.closed = True
        self.server.close()

    def describe(self) -> dict:
        if self.address:
            addresses = [self.address]
        else:  # listening everywhere: the names the other ranks may resolve
            addresses = [a for a in (os.environ.get("HOROVOD_HOSTNAME"), socket.gethostname(), socket.getfqdn()) if a]
        return {"rank": self.rank, "host": launcher.host_name(), "addresses": list(dict.fromkeys(addresses)),
                "port": self.port, "pid": os.getpid(), "token": self.token.hex()}


def ping(peer: Peer, timeout: float = 2.0) -> str:
    """'alive', 'gone' (connection refused: the process is dead) or 'no answer' (hung, unreachable,
    or a reply that does not prove the peer's token)."""
    verdict = "no answer"
    token = bytes.fromhex(peer.token)
    rank = str(peer.rank).encode()
    for address in peer.addresses:
        nonce = secrets.token_hex(16).encode()
        deadline = time.monotonic() + timeout
        try:
            with socket.create_connection((address, peer.port), timeout=timeout) as conn:
                conn.sendall(PING + nonce + b" " + proof(token, b"ping", nonce) + b"\n")
                reply = b""
                while b"\n" not in reply and len(reply) < MAX_LINE:
                    conn.settimeout(max(0.001, deadline - time.monotonic()))
                    chunk = conn.recv(MAX_LINE)
                    if not chunk:
                        break
                    reply += chunk
                expected = PONG + rank + b" " + proof(token, b"alive", nonce, rank)
                if hmac.compare_digest(reply.split(b"\n", 1)[0], expected):
                    return "alive"
        except ConnectionRefusedError:
            verdict = "gone"
        except OSError:
            continue
    return verdict


def lost_peers(peers: list[Peer], own_rank: int) -> list[tuple[Peer, str]]:
    """Peers that do not answer, checked in parallel."""
    results: dict[int, str] = {}

    def check(peer: Peer) -> None:
        results[peer.rank] = ping(peer)

    threads = [threading.Thread(target=check, args=(p,), daemon=True) for p in peers if p.rank != own_rank]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5.0)
    return [(p, results.get(p.rank, "no answer")) for p in peers
            if p.rank != own_rank and results.get(p.rank, "no answer") != "alive"]


def lost_message(peers: list[Peer], own_rank: int, what: str) -> tuple[str, bool, bool]:
    """The line, whether this rank prints it (the lowest one alive), and whether a peer is lost (exit 75)."""
    lost = lost_peers(peers, own_rank)
    lost_ranks = {p.rank for p, _ in lost}
    speaker = min(p.rank for p in peers if p.rank not in lost_ranks)
    if lost:
        names = "; ".join(f"{p.label()}: {verdict}" for p, verdict in lost)
        line = f"hvdtrain: {what}: lost {names}. Stopping the job; resume with the same command."
    else:
        line = f"hvdtrain: {what}; every rank still answers, so a collective is stuck. Stopping the job."
    return line, own_rank == speaker, bool(lost)
