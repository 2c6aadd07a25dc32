"""No silent hangs: a progress watchdog, and a liveness check that names the lost rank.

A rank killed outright is noticed by the launcher (horovodrun, mpirun and srun end the job when a
process exits). A rank that hangs, or a node that drops off the network, is not: the others wait
in a collective forever (MPI has no timeout; Gloo gives up after ``HOROVOD_GLOO_TIMEOUT_SECONDS``
without saying which peer it waited for). So every rank runs:

* a tiny TCP service that answers "alive" from its own thread, whose address every rank knows;
* a watchdog thread that, armed during the training and validation loops, ends the process when
  no step or batch has completed for ``dist.timeout_seconds``.

Before a rank gives up it asks every peer's service whether it is alive and prints one line naming
the ranks (and hosts, and process ids) that did not answer, then exits non-zero; the launcher
tears the job down.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from . import launcher

PING, PONG = b"hvdtrain-ping\n", b"hvdtrain-alive "


@dataclass
class Peer:
    rank: int
    host: str
    addresses: list[str]
    port: int
    pid: int

    def label(self) -> str:
        return f"rank {self.rank} ({self.host}, pid {self.pid})"


class LivenessService:
    """Answers pings from other ranks, from a daemon thread (it keeps answering while the main
    thread is stuck in a collective, but not when the process is stopped or gone)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.server = socket.create_server(("", 0), backlog=64)
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._serve, name="hvdtrain-liveness", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(1.0)
                try:
                    if conn.recv(len(PING)) == PING:
                        conn.sendall(PONG + str(self.rank).encode() + b"\n")
                except OSError:
                    pass

    def describe(self) -> dict:
        addresses = [a for a in (os.environ.get("HOROVOD_HOSTNAME"), socket.gethostname(), socket.getfqdn()) if a]
        return {"rank": self.rank, "host": launcher.host_name(),
                "addresses": list(dict.fromkeys(addresses)), "port": self.port, "pid": os.getpid()}


def ping(peer: Peer, timeout: float = 2.0) -> str:
    """'alive', 'gone' (connection refused: the process is dead) or 'no answer' (hung or unreachable)."""
    verdict = "no answer"
    for address in peer.addresses:
        try:
            with socket.create_connection((address, peer.port), timeout=timeout) as conn:
                conn.settimeout(timeout)
                conn.sendall(PING)
                reply = conn.recv(64)
                if reply.startswith(PONG) and reply[len(PONG):].strip() == str(peer.rank).encode():
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


def lost_message(peers: list[Peer], own_rank: int, what: str) -> tuple[str, bool]:
    """The line to print, and whether this rank should print it (the lowest rank still alive)."""
    lost = lost_peers(peers, own_rank)
    lost_ranks = {p.rank for p, _ in lost}
    speaker = min(p.rank for p in peers if p.rank not in lost_ranks)
    if lost:
        names = "; ".join(f"{p.label()}: {verdict}" for p, verdict in lost)
        line = f"hvdtrain: {what}: lost {names}. Stopping the job; resume with the same command."
    else:
        line = f"hvdtrain: {what}; every rank still answers, so a collective is stuck. Stopping the job."
    return line, own_rank == speaker


class Watchdog:
    """Ends the process when an armed loop makes no progress for ``timeout`` seconds."""

    def __init__(self, timeout: float, peers: list[Peer], own_rank: int):
        self.timeout = timeout
        self.peers = peers
        self.own_rank = own_rank
        self.last_beat = time.monotonic()
        self.armed = False
        if timeout > 0:
            threading.Thread(target=self._watch, name="hvdtrain-watchdog", daemon=True).start()

    def beat(self) -> None:
        self.last_beat = time.monotonic()
        self.armed = True

    def disarm(self) -> None:
        self.armed = False

    def _watch(self) -> None:
        interval = min(1.0, self.timeout / 4)
        tick = time.monotonic()
        while True:
            time.sleep(interval)
            now, previous = time.monotonic(), tick
            tick = now
            if now - previous > interval + 5:
                # This process itself was suspended (SIGSTOP, a frozen VM): the silence was ours.
                self.last_beat = now
                continue
            if self.armed and now - self.last_beat > self.timeout:
                line, speak = lost_message(self.peers, self.own_rank,
                                           f"no progress for {self.timeout:g}s (dist.timeout_seconds)")
                if speak:
                    print(line, file=sys.stderr, flush=True)
                os._exit(1)
