"""The torch engine's store (comm/torch_engine.py): where the ranks meet, bound to the job's own
address, and open only to processes that know the job's secret.

- Rank 0 listens on ``MASTER_ADDR:MASTER_PORT`` alone (loopback when MASTER_ADDR is a loopback
  address, never every interface); a port in use or an address of another host is one line. Under
  torchrun the store is torchrun's own (its agent's), which every rank joins as a client.
- Before anything in the store is used, the ranks prove that they know ``HVDTRAIN_JOB_SECRET``
  (the same value in every rank's environment, at least 32 characters, never in argv): each rank
  r > 0 writes a nonce of its own choosing, rank 0 answers with an HMAC over it and its own nonce
  (so a store that is not the job's, a process that listened first on MASTER_PORT, is found out
  before a rank acts on anything it says), then rank r answers rank 0's nonce (so a process that
  joined the store as "rank r" is found out). Either way every rank stops with one line naming what
  was refused (for a process on this host: its address and user, from /proc/net/tcp).
- Afterwards every value the ranks write into the store carries an HMAC (``SignedStore``): an entry
  written by a process without the secret (Gloo's or NCCL's addresses, say) is refused, not used.
"""

from __future__ import annotations

import datetime
import errno
import hashlib
import hmac
import ipaddress
import json
import os
import pwd
import secrets
import socket
import time

import torch.distributed as tdist

from ..config import ConfigError
from .launcher_env import spans_hosts

SECRET_VARIABLE = "HVDTRAIN_JOB_SECRET"
SECRET_MIN = 32  # characters: e.g. `openssl rand -hex 32` gives 64
MAKE_SECRET = f"export {SECRET_VARIABLE}=$(openssl rand -hex 32)"
AUTH = "hvdtrain/auth/"
MAC_BYTES = 32
POLL_SECONDS = 0.02


class StoreRefused(ConfigError):
    """The store, or a process in it, did not prove the job's secret: the job stops."""


def job_secret() -> bytes:
    """The job's secret from the environment; one line where it is missing or too short."""
    value = os.environ.get(SECRET_VARIABLE, "")
    if len(value) < SECRET_MIN:
        what = "is not set" if not value else f"has {len(value)} characters, fewer than {SECRET_MIN}"
        raise ConfigError(f"dist.engine=torch with more than one rank needs a per-job secret, and {SECRET_VARIABLE} "
                          f"{what}: {MAKE_SECRET} in the job script before torchrun, srun or mpirun (mpirun: add "
                          f"-x {SECRET_VARIABLE}), so that only the job's ranks can use its store")
    return value.encode()


def mac(key: bytes, *parts: str | bytes) -> bytes:
    message = b"\0".join(part.encode() if isinstance(part, str) else part for part in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


def bind_address(host: str) -> str:
    """The address rank 0's store listens on: MASTER_ADDR's own (loopback for a loopback name)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"MASTER_ADDR={host} does not resolve ({error.strerror}): set it to rank 0's host "
                          "name or address") from None
    addresses = [info[4][0] for info in infos]
    return next((a for a in addresses if ipaddress.ip_address(a).version == 4), addresses[0])


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``'s address and ``port`` alone, listening; one line where it cannot be."""
    address = bind_address(host)
    if ipaddress.ip_address(address).is_loopback and spans_hosts():
        raise ConfigError(f"MASTER_ADDR={host} is {address} on rank 0's host, a loopback address the job's other "
                          "hosts cannot reach: export MASTER_ADDR as rank 0's address on the network the hosts "
                          "share (e.g. the first of `hostname -I`)")
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT; never two listeners
        sock.bind((address, port))
        sock.listen(1024)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(f"MASTER_PORT={port} is in use on {address} (another job, or another process, "
                              "listens there): export a free port as MASTER_PORT (or torchrun --master_port), "
                              "one per job on a shared host") from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise ConfigError(f"MASTER_ADDR={host} ({address}) is not an address of this host, which runs rank 0: "
                              "set MASTER_ADDR to rank 0's host") from None
        raise ConfigError(f"the store cannot listen on {address}:{port} ({error.strerror}): export another "
                          "MASTER_PORT") from None
    return sock


def open_store(rank: int, world_size: int, timeout: datetime.timedelta) -> tdist.TCPStore:
    """The job's TCPStore: rank 0 serves it on MASTER_ADDR's address alone; the others join. Under
    torchrun (TORCHELASTIC_USE_AGENT_STORE) every rank joins torchrun's own."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        sock = listen(host, port)
        return tdist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=sock.detach())
    try:
        return tdist.TCPStore(host, port, world_size, False, timeout)
    except (RuntimeError, tdist.DistError) as error:
        raise ConfigError(f"rank {rank} cannot reach the job's store at {host}:{port} within "
                          f"{int(timeout.total_seconds())} s ({str(error).splitlines()[0][:120]}): is rank 0 "
                          "running, and MASTER_ADDR and MASTER_PORT the same on every rank?") from None


def wait_for(store: tdist.Store, keys: list[str], timeout: float) -> str | None:
    """The first of ``keys`` that the store has, or None after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        for key in keys:
            if store.check([key]):
                return key
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL_SECONDS)


def authenticate(store: tdist.Store, rank: int, world_size: int, secret: bytes, timeout: float,
                 where: str) -> bytes:
    """The handshake (module docstring); returns the key that signs the store's values afterwards."""
    if rank == 0:
        return verify_ranks(store, world_size, secret, timeout, where)
    return prove_rank(store, rank, secret, timeout, where)


def not_the_jobs(where: str, why: str) -> StoreRefused:
    return StoreRefused(f"the store at {where} is not this job's ({why}): another process may listen on MASTER_PORT "
                        f"(listening: {connections(where, listening=True)}), or the ranks' {SECRET_VARIABLE} differ; "
                        "stopping without using it")


def prove_rank(store: tdist.Store, rank: int, secret: bytes, timeout: float, where: str) -> bytes:
    mine = secrets.token_hex(16)
    claim = store.add(f"{AUTH}claims/{rank}", 1)
    hello = json.dumps({"nonce": mine, "host": socket.gethostname(), "pid": os.getpid()})
    store.set(f"{AUTH}hello/{rank}/{claim}", hello)
    answer_key, verdict_key = f"{AUTH}answer/{rank}/{claim}", f"{AUTH}verdict"
    found = wait_for(store, [answer_key, verdict_key], timeout)
    if found is None:
        raise not_the_jobs(where, f"no answer to rank {rank}'s challenge in {timeout:.0f} s")
    # Decided before this rank was answered: the verdict says why. (An answer set between the two
    # checks of wait_for is still taken first: it is what the one who answered must prove.)
    if found == verdict_key and not store.check([answer_key]):
        verdict(store, secret, None, where)
        raise not_the_jobs(where, f"rank 0 decided without answering rank {rank}")
    try:
        answer = json.loads(store.get(answer_key))
        theirs, proof = str(answer["nonce"]), bytes.fromhex(answer["mac"])
    except (ValueError, KeyError, TypeError):
        raise not_the_jobs(where, "its answer is malformed") from None
    if not hmac.compare_digest(proof, mac(secret, "answer", str(rank), str(claim), mine, theirs)):
        store.set(f"{AUTH}proof/{rank}/{claim}", "")  # rank 0, if it is the job's, need not wait
        raise not_the_jobs(where, "it could not prove the job's secret")
    store.set(f"{AUTH}proof/{rank}/{claim}", mac(secret, "proof", str(rank), str(claim), theirs, mine).hex())
    if wait_for(store, [verdict_key], timeout) is None:
        raise not_the_jobs(where, f"no verdict from rank 0 in {timeout:.0f} s")
    return verdict(store, secret, theirs, where)


def verdict(store: tdist.Store, secret: bytes, theirs: str | None, where: str):
    """Rank 0's verdict, checked: the signing key when every rank proved the secret; else raised."""
    try:
        said = json.loads(store.get(f"{AUTH}verdict"))
        line, nonce, proof = str(said["line"]), str(said["nonce"]), bytes.fromhex(said["mac"])
    except (ValueError, KeyError, TypeError):
        raise not_the_jobs(where, "its verdict is malformed") from None
    if (theirs is not None and nonce != theirs) or \
            not hmac.compare_digest(proof, mac(secret, "verdict", nonce, line)):
        raise not_the_jobs(where, "its verdict is not signed with the job's secret")
    if line:
        raise StoreRefused(line)
    return mac(secret, "signing", nonce)


def verify_ranks(store: tdist.Store, world_size: int, secret: bytes, timeout: float, where: str) -> bytes:
    mine = secrets.token_hex(16)
    refused = ""
    for rank in range(1, world_size):
        hello_key = f"{AUTH}hello/{rank}/1"
        if wait_for(store, [hello_key], timeout) is None:
            refused = f"rank {rank} did not reach the store at {where} in {timeout:.0f} s; stopping"
            break
        try:
            hello = json.loads(store.get(hello_key))
            theirs = str(hello["nonce"])
        except (ValueError, KeyError, TypeError):
            refused = intruder(where, rank, {}, "sent a malformed challenge")
            break
        store.set(f"{AUTH}answer/{rank}/1",
                  json.dumps({"nonce": mine, "mac": mac(secret, "answer", str(rank), "1", theirs, mine).hex()}))
        proof_key = f"{AUTH}proof/{rank}/1"
        if wait_for(store, [proof_key], timeout) is None:
            refused = intruder(where, rank, hello, f"did not answer in {timeout:.0f} s")
            break
        try:
            proof = bytes.fromhex(store.get(proof_key).decode())
        except ValueError:
            proof = b""
        if not hmac.compare_digest(proof, mac(secret, "proof", str(rank), "1", mine, theirs)):
            refused = intruder(where, rank, hello, "could not prove the job's secret")
            break
    for rank in range(1, world_size if not refused else 1):
        claims = store.add(f"{AUTH}claims/{rank}", 0)
        if claims > 1:
            try:
                second = f"{AUTH}hello/{rank}/2"
                hello = json.loads(store.get(second)) if store.check([second]) else {}
            except (ValueError, TypeError):
                hello = {}
            refused = intruder(where, rank, hello, f"claimed a rank already taken ({claims} claims)")
            break
    store.set(f"{AUTH}verdict", json.dumps({"line": refused, "nonce": mine,
                                            "mac": mac(secret, "verdict", mine, refused).hex()}))
    if refused:
        raise StoreRefused(refused)
    return mac(secret, "signing", mine)


def intruder(where: str, rank: int, hello: dict, what: str) -> str:
    claimed = f", claiming host {str(hello.get('host'))[:64]} pid {str(hello.get('pid'))[:12]}" if hello else ""
    return (f"a process that is not one of this job's ranks joined the store at {where} as rank {rank} and {what}"
            f"{claimed}; connected: {connections(where)}; stopping the job")


def connections(where: str, listening: bool = False) -> str:
    """Who listens on the store's port on this host, or (``listening`` False) holds a connection to
    it: address and user, from /proc/net/tcp, other users' first; "unknown" where the table cannot
    tell (a process on another host)."""
    port = int(where.rsplit(":", 1)[1])
    rows = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table, encoding="ascii") as lines:
                rows += [line.split() for line in list(lines)[1:]]
        except OSError:
            continue
    # (local address, remote address, state, uid), addresses as text: an IPv4 client of an IPv6
    # socket shows as ::ffff:a.b.c.d in tcp6 and as a.b.c.d in tcp.
    rows = [(address_of(row[1]), address_of(row[2]), row[3], int(row[7])) for row in rows if len(row) > 7]
    at_port = [row for row in rows if row[0].endswith(f":{port}")]
    if listening:
        chosen = [(row[0], row[3]) for row in at_port if row[2] == "0A"]
    else:  # the other end of each connection the store serves: its local address is the client's
        served = {row[1] for row in at_port if row[2] == "01"}
        chosen = [(row[0], row[3]) for row in rows if row[0] in served and row[2] == "01"]
    found = []
    for address, uid in chosen:
        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
        found.append((uid == os.getuid(), f"{address} (user {user}, uid {uid})"))
    found.sort(key=lambda entry: entry[0])
    return ", ".join(text for _, text in found[:6]) or "unknown (a process on another host)"


def address_of(hex_address: str) -> str:
    """``0100007F:D2B6`` (/proc/net/tcp's form) as ``127.0.0.1:53942``."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    text = socket.inet_ntop(socket.AF_INET6, words)
    return f"{text.removeprefix('::ffff:')}:{int(port, 16)}" if text.startswith("::ffff:") and "." in text \
        else f"[{text}]:{int(port, 16)}"


class SignedStore(tdist.Store):
    """The job's store as the process group sees it: every value written carries an HMAC with the
    key the handshake agreed on; a value without a valid one is refused (one line), never used."""

    def __init__(self, inner: tdist.Store, key: bytes, where: str):
        super().__init__()
        self.inner, self.key, self.where = inner, key, where

    def set(self, key: str, value) -> None:
        data = value.encode() if isinstance(value, str) else bytes(value)
        self.inner.set(key, data + mac(self.key, key, data))

    def get(self, key: str) -> bytes:
        data = self.inner.get(key)
        body, proof = data[:-MAC_BYTES], data[-MAC_BYTES:]
        if len(data) < MAC_BYTES or not hmac.compare_digest(proof, mac(self.key, key, body)):
            raise StoreRefused(f"the entry {key[:80]!r} in the store at {self.where} was not written by one of "
                               f"this job's ranks (no valid signature); connected: {connections(self.where)}; "
                               "stopping the job")
        return body

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)


def join(rank: int, world_size: int, timeout: datetime.timedelta) -> tdist.Store:
    """The store the process group uses: opened, the ranks proven, signed (module docstring)."""
    secret = job_secret()
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    store = open_store(rank, world_size, timeout)
    key = authenticate(store, rank, world_size, secret, timeout.total_seconds(), where)
    return SignedStore(store, key, where)
