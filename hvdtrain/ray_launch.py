"""``hvdtrain ray``: one training job on a Ray cluster, one Ray actor per rank.

    python -m hvdtrain ray -np 4 --gpus-per-rank 1 -- --config imagenet_resnet50 data.dir=/data/imagenet

A small coordinator built on Horovod's public launcher pieces, in the order horovodrun's Gloo mode
(horovod/runner/gloo_run.py) does the same work:

1. One placement-group bundle per rank ({CPU: C, GPU: G, extra resources}), PACK or SPREAD, and
   one actor per bundle (PlacementGroupSchedulingStrategy). Each actor says where it landed:
   Ray node id, node IP, the network interface holding that IP, its GPUs.
2. Ranks are assigned per node with Horovod's own ``get_host_assignments`` (ranks on a node
   contiguous; local and cross ranks and sizes as horovodrun computes them). A node is named by
   its IP (HOROVOD_HOSTNAME), which is unique per Ray node where host names may not be.
3. Horovod's Gloo rendezvous server starts on the driver, listening on the rendezvous address
   only and refusing requests without the job's token (TokenHandler), and is told that plan;
   every actor gets the HOROVOD_* variables gloo_run sets (rank, size, local/cross rank and
   size, rendezvous address, with the token, and port, controller and CPU operations gloo, the
   interface) and, with GPUs, a
   CUDA_VISIBLE_DEVICES listing its node's GPUs in local-rank order (hvdtrain picks device
   local_rank, as under horovodrun).
4. Each actor runs the rank as a child process (``python -m hvdtrain train ...``), not inside the
   actor: Horovod initializes once per process, SIGTERM must reach the training loop's own
   handler (preemption.py) in its main thread, and a crash (a Gloo segfault) must end one rank
   with an exit status, not take the actor down with an unreadable error. The child dies with
   its actor (PR_SET_PDEATHSIG) so that a lost actor never leaves a rank training alone.
5. The driver polls every actor twice a second: rank 0's output goes to this terminal, other
   ranks' stderr is shown prefixed with their rank and node. A rank that exits with a failure,
   an actor that dies or stops answering (its node lost) ends the job: every rank is killed and
   one line names the rank and node. SIGTERM or Ctrl-C here sends SIGTERM to every rank: they
   agree to stop, checkpoint and exit 75 (preemption), and so does this command; a second
   Ctrl-C kills them. The actors and the placement group are released whatever happens.

Ray is imported only when the command runs: ``pip install -e .[ray]`` installs the tested version.
"""

from __future__ import annotations

import argparse
import collections
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from . import outcome

INSTALL_HINT = "Ray is not installed: pip install -e .[ray] (or make setup EXTRAS=ray)"
EXIT_PREEMPTED = outcome.EXIT_PREEMPTED  # the one map (outcome.py; light: no torch on the driver)
POLL_SECONDS = 0.5
# An actor that has not answered a poll for this long is taken as lost (its node died or hangs);
# Ray itself reports a dead actor sooner, when its worker process or raylet is gone.
ANSWER_SECONDS = 45.0
# Once one rank has finished or stopped for preemption, how long the others may take to follow.
FOLLOW_SECONDS = 120.0
TAIL_LINES = 30


class RayLaunchError(Exception):
    """A problem this command reports in one line (bad arguments, a cluster that cannot host the job)."""


# --- arguments -------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvdtrain ray", usage="python -m hvdtrain ray -np N [options] -- [--config FILE] [key=value ...]",
        description="Run one training job on a Ray cluster: one Ray actor per rank in a placement group, "
        "Horovod's Gloo controller between them. Arguments after '--' are the train command's.",
        epilog="Details, the cluster-launcher config and KubeRay: docs/ray.md.")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True, help="number of ranks")
    p.add_argument("--address", default="auto", help="Ray cluster to join (ray.init address; default: auto, "
                   "the cluster this node belongs to or RAY_ADDRESS)")
    p.add_argument("--cpus-per-rank", type=float, default=1, help="CPUs each rank reserves (default 1)")
    p.add_argument("--gpus-per-rank", type=float, default=0, help="GPUs each rank reserves (default 0)")
    p.add_argument("--resource", action="append", default=[], metavar="NAME=AMOUNT",
                   help="a custom Ray resource each rank reserves as well (repeatable)")
    p.add_argument("--strategy", choices=("pack", "spread"), default="pack",
                   help="placement: pack ranks onto as few nodes as possible (default), or spread them")
    p.add_argument("--placement-timeout", type=float, default=300, metavar="S",
                   help="seconds to wait for the cluster to grant every rank's bundle (default 300)")
    p.add_argument("--rendezvous-port", type=int, default=0, metavar="PORT",
                   help="port of Horovod's rendezvous server on this machine (default: any free port)")
    p.add_argument("--rendezvous-addr", default="", metavar="IP", help="address the ranks reach this "
                   "machine at (default: this driver's Ray node IP)")
    p.add_argument("--chdir", default="", metavar="DIR", help="working directory of the ranks (default: this "
                   "command's directory where it exists on the rank's node, else the Ray worker's own)")
    p.add_argument("--script", default="", metavar="FILE", help="run 'python FILE ARGS' on every rank instead "
                   "of 'python -m hvdtrain train ARGS' (a wrapper of your own)")
    return p


@dataclass
class Options:
    np: int
    address: str
    bundle: dict[str, float]
    strategy: str
    placement_timeout: float
    rendezvous_port: int
    rendezvous_addr: str
    chdir: str
    program: list[str]


def parse_args(argv: list[str]) -> Options:
    """This command's options before '--', the rank's arguments after it."""
    own, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser().parse_args(own)
    if args.np < 1:
        raise RayLaunchError(f"-np {args.np}: the number of ranks must be at least 1")
    if args.cpus_per_rank < 0 or args.gpus_per_rank < 0:
        raise RayLaunchError("--cpus-per-rank and --gpus-per-rank cannot be negative")
    bundle = {"CPU": args.cpus_per_rank}
    if args.gpus_per_rank:
        bundle["GPU"] = args.gpus_per_rank
    for item in args.resource:
        name, _, amount = item.partition("=")
        try:
            bundle[name] = float(amount)
        except ValueError:
            raise RayLaunchError(f"--resource {item}: expected NAME=AMOUNT, e.g. --resource hvd_slot=1") from None
    if not args.script and not rest:
        raise RayLaunchError("nothing to train: add the train arguments after '--', e.g. "
                             "python -m hvdtrain ray -np 2 -- --config demo")
    program = [args.script, *rest] if args.script else ["-m", "hvdtrain", "train", *rest]
    return Options(args.np, args.address, bundle, args.strategy, args.placement_timeout, args.rendezvous_port,
                   args.rendezvous_addr, args.chdir or os.getcwd(), program)


def check_train_args(train_args: list[str]) -> None:
    """The train arguments as the ranks will read them, checked here first: a typo in a key is one
    line now, not a line per rank after the cluster has started every actor."""
    from .arguments import require_data_choice, train_parser
    from .config import load_config

    args = train_parser("hvdtrain ray -- ").parse_args(train_args)
    require_data_choice(args.config, load_config(args.config, args.overrides))


# --- rank assignment (pure: unit-tested without Ray) -------------------------------------------

@dataclass
class Placement:
    """Where one actor landed, as it reported itself."""
    node_id: str
    ip: str
    iface: str
    gpus: list[str]


@dataclass
class Slot:
    """One rank's place in the job, as horovodrun would give it; ``actor`` indexes the actors."""
    actor: int
    rank: int
    local_rank: int
    cross_rank: int
    size: int
    local_size: int
    cross_size: int
    host: str


def host_names(placements: list[Placement]) -> dict[str, str]:
    """A name per Ray node for HOROVOD_HOSTNAME and the rendezvous' local scopes: its IP, unique per
    node on a real cluster; several Ray nodes on one IP (test clusters) get the node id added."""
    ips: dict[str, set[str]] = collections.defaultdict(set)
    for place in placements:
        ips[place.ip].add(place.node_id)
    return {p.node_id: p.ip if len(ips[p.ip]) == 1 else f"{p.ip}-{p.node_id[:8]}" for p in placements}


def assign_ranks(placements: list[Placement]) -> list[Slot]:
    """Ranks for the actors: nodes in the order of their first bundle, ranks contiguous on a node,
    local and cross ranks from Horovod's own get_host_assignments (what horovodrun -H does)."""
    from horovod.runner.common.util.hosts import HostInfo, get_host_assignments

    names = host_names(placements)
    by_node: dict[str, list[int]] = {}
    for index, place in enumerate(placements):
        by_node.setdefault(place.node_id, []).append(index)
    hosts = [HostInfo(names[node], len(actors)) for node, actors in by_node.items()]
    plan = get_host_assignments(hosts, len(placements))
    actors = [index for indices in by_node.values() for index in indices]  # in rank order
    return [Slot(actor, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size, s.cross_size, s.hostname)
            for actor, s in zip(actors, plan)]


def rank_env(slot: Slot, iface: str, rendezvous_addr: str, rendezvous_port: int,
             node_gpus: list[str]) -> dict[str, str]:
    """The environment gloo_run gives a rank (create_slot_env_vars + create_run_env_vars)."""
    env = {
        "HOROVOD_HOSTNAME": slot.host, "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
        "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
        "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size),
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": rendezvous_addr, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(rendezvous_port),
        "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "PYTHONUNBUFFERED": "1",
    }
    if iface:
        env["HOROVOD_GLOO_IFACE"] = env["NCCL_SOCKET_IFNAME"] = iface
    if node_gpus:  # Ray gave each actor only its own GPUs; a rank uses device local_rank of its node's
        env["CUDA_VISIBLE_DEVICES"] = ",".join(node_gpus)
    return env


def node_gpus(slots: list[Slot], placements: list[Placement]) -> dict[str, list[str]]:
    """Per host name, the GPUs of its ranks in local-rank order."""
    gpus: dict[str, list[str]] = collections.defaultdict(list)
    for slot in sorted(slots, key=lambda s: s.rank):
        gpus[slot.host].extend(placements[slot.actor].gpus)
    return gpus


def interface_of(ip: str) -> str:
    """The network interface that holds ``ip`` on this machine ('' when none is found: Gloo picks)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(address.family == socket.AF_INET and address.address == ip for address in addresses):
            return name
    if ipaddress.ip_address(ip).is_loopback:  # 127.x addresses answer on lo without being listed
        return next((name for name, addresses in psutil.net_if_addrs().items()
                     if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses)), "")
    return ""


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit status {code}"


# --- the actor ---------------------------------------------------------------------------------

def die_with_parent() -> None:
    """In the rank's child process: die when the actor's process does (Linux), so that an actor that
    Ray kills or loses never leaves a rank behind, stuck in a collective."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class RankActor:
    """One rank's Ray actor: reports where it landed, then runs the rank as a child process and
    hands its output to the driver's polls."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None
        self.pending: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self.readers: list[threading.Thread] = []

    def where(self) -> dict[str, Any]:
        import ray

        ip = ray.util.get_node_ip_address()
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ip, "iface": interface_of(ip),
                "gpus": [str(g) for g in ray.get_gpu_ids()]}

    def start(self, program: list[str], env: dict[str, str], chdir: str) -> int:
        cwd = chdir if os.path.isdir(chdir) else os.getcwd()
        self.process = subprocess.Popen(
            [sys.executable, *program], cwd=cwd, env={**os.environ, **env}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1, start_new_session=True,
            preexec_fn=die_with_parent)
        for name, stream in (("out", self.process.stdout), ("err", self.process.stderr)):
            reader = threading.Thread(target=self._read, args=(name, stream), daemon=True)
            reader.start()
            self.readers.append(reader)
        return self.process.pid

    def _read(self, name: str, stream) -> None:
        for line in stream:
            with self.lock:
                self.pending.append((name, line))

    def poll(self) -> tuple[int | None, list[tuple[str, str]]]:
        """The exit status (None while running) and the output lines since the last poll."""
        code = self.process.poll() if self.process else None
        if code is not None:
            for reader in self.readers:  # the last lines, which say why it ended
                reader.join(timeout=5)
        with self.lock:
            lines, self.pending = self.pending, []
        return code, lines

    def send(self, signum: int) -> None:
        """A signal to the rank itself (its loader workers follow the rank)."""
        if self.process and self.process.poll() is None:
            os.kill(self.process.pid, signum)

    def kill(self) -> None:
        """The rank and every process it started."""
        if self.process and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(timeout=10)


# --- the driver --------------------------------------------------------------------------------

class Interrupted(Exception):
    """Ctrl-C or SIGTERM before the ranks started, or a second one after."""


class Job:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.placement_group = None
        self.actors: list[Any] = []
        self.slots: list[Slot] = []
        self.placements: list[Placement] = []
        self.rendezvous = None
        self.started = False
        self.stop_signal: int | None = None
        self.stop_sent = False

    # signals: before the ranks run, a signal just ends the launch (cleanly); after, the first one
    # asks every rank to checkpoint and stop, a second one kills them.
    def _on_signal(self, signum: int, frame) -> None:  # noqa: ARG002 - signal handler signature
        if not self.started or self.stop_signal is not None:
            raise Interrupted(signal.Signals(signum).name)
        self.stop_signal = signum

    def run(self) -> int:
        import ray

        try:
            ray.init(address=self.options.address, log_to_driver=False, logging_level="WARNING",
                     configure_logging=True)
        except ConnectionError as error:
            raise RayLaunchError(f"no Ray cluster at --address {self.options.address} ({str(error).splitlines()[0]}): "
                                 "start one (ray start --head, ray up) or name it with --address") from None
        # After ray.init: Ray's core worker installs a handler that aborts the driver on SIGTERM
        # (exit -6, nothing released); this one takes its place for the job and hands it back after.
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        try:
            self.place()
            self.start_ranks()
            return self.supervise()
        except Interrupted as interrupted:
            print(f"hvdtrain ray: {interrupted}: ending the job", file=sys.stderr, flush=True)
            return 130
        finally:
            self.release()
            for sig, handler in previous.items():  # None: a handler not set from Python (Ray's)
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)

    def place(self) -> None:
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        options = self.options
        self.placement_group = placement_group([dict(options.bundle)] * options.np,
                                               strategy=options.strategy.upper())
        try:
            ray.get(self.placement_group.ready(), timeout=options.placement_timeout)
        except GetTimeoutError:
            raise RayLaunchError(
                f"the cluster did not grant {options.np} bundles of {options.bundle} ({options.strategy}) within "
                f"{options.placement_timeout:.0f} s (free now: {ray.available_resources()}): lower -np or the "
                "resources per rank, add nodes, or raise --placement-timeout") from None
        remote = ray.remote(RankActor)
        extra = {k: v for k, v in options.bundle.items() if k not in ("CPU", "GPU")}
        self.actors = [remote.options(
            num_cpus=options.bundle["CPU"], num_gpus=options.bundle.get("GPU", 0), resources=extra,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i),
        ).remote() for i in range(options.np)]
        self.placements = [Placement(**where) for where in ray.get([a.where.remote() for a in self.actors])]
        self.slots = assign_ranks(self.placements)

    def start_ranks(self) -> None:
        import ray
        from horovod.runner.common.util.hosts import SlotInfo

        options = self.options
        addr = options.rendezvous_addr or ray.util.get_node_ip_address()
        self.rendezvous, port = start_rendezvous(options.rendezvous_port, addr)
        self.rendezvous.init([SlotInfo(s.host, s.rank, s.local_rank, s.cross_rank, s.size, s.local_size,
                                       s.cross_size) for s in sorted(self.slots, key=lambda s: s.rank)])
        gloo_addr = rendezvous_addr(addr, port, self.rendezvous.token)
        gpus = node_gpus(self.slots, self.placements)
        ray.get([self.actors[s.actor].start.remote(
            options.program, rank_env(s, self.placements[s.actor].iface, gloo_addr, port, gpus[s.host]),
            options.chdir) for s in self.slots])
        self.started = True
        hosts = sorted({s.host for s in self.slots}, key=lambda h: min(s.rank for s in self.slots if s.host == h))
        print(f"hvdtrain ray: {len(self.slots)} ranks on {len(hosts)} node(s) ({', '.join(hosts)}), rendezvous at "
              f"{addr}:{port}", file=sys.stderr, flush=True)

    def where(self, slot: Slot) -> str:
        return f"rank {slot.rank} on node {slot.host}"

    def show(self, slot: Slot, lines: list[tuple[str, str]]) -> None:
        for stream, line in lines:
            if slot.rank == 0:
                (sys.stdout if stream == "out" else sys.stderr).write(line)
            elif stream == "err":
                sys.stderr.write(f"[{self.where(slot)}] {line}")
        sys.stdout.flush()
        sys.stderr.flush()

    def supervise(self) -> int:
        """Poll every rank until all have ended; returns this command's exit status."""
        import ray
        from ray.exceptions import RayActorError

        by_rank = sorted(self.slots, key=lambda s: s.rank)
        codes: dict[int, int] = {}
        asked = {s.rank: (self.actors[s.actor].poll.remote(), time.monotonic()) for s in by_rank}
        first_end: float | None = None
        while True:
            if self.stop_signal is not None and not self.stop_sent:
                self.stop_sent = True
                name = signal.Signals(self.stop_signal).name
                print(f"hvdtrain ray: {name}: asking every rank to checkpoint and stop", file=sys.stderr, flush=True)
                ray.get([self.actors[s.actor].send.remote(signal.SIGTERM) for s in by_rank if s.rank not in codes])
            ready, _ = ray.wait([ref for ref, _ in asked.values()], num_returns=len(asked), timeout=POLL_SECONDS)
            now = time.monotonic()
            # (weight, rank, slot, why, status): when several ranks end in one poll, the cause is named,
            # not the peer that failed because of it (a killed rank's partner fails its next collective).
            failures: list[tuple[int, int, Slot, str, int]] = []
            for slot in by_rank:
                if slot.rank not in asked:
                    continue
                ref, since = asked[slot.rank]
                if ref not in ready:
                    if now - since > ANSWER_SECONDS:
                        failures.append((1, slot.rank, slot, f"its Ray actor has not answered for "
                                                             f"{ANSWER_SECONDS:.0f} s (node lost or hung)", 1))
                    continue
                try:
                    code, lines = ray.get(ref)
                except RayActorError as error:
                    failures.append((0, slot.rank, slot, f"its Ray actor died ({str(error).splitlines()[0][:200]})", 1))
                    continue
                self.show(slot, lines)
                if code is None:
                    asked[slot.rank] = (self.actors[slot.actor].poll.remote(), now)
                    continue
                del asked[slot.rank]
                codes[slot.rank] = code
                if code not in (0, EXIT_PREEMPTED):
                    failures.append((0 if code < 0 else 2, slot.rank, slot, f"it exited with {describe_exit(code)}",
                                     code))
                first_end = first_end or now
            if failures:
                _, _, slot, why, code = min(failures, key=lambda failure: failure[:2])
                return self.fail(slot, why, code)
            if not asked:
                return EXIT_PREEMPTED if EXIT_PREEMPTED in codes.values() else 0
            if first_end is not None and now - first_end > FOLLOW_SECONDS:
                late = next(s for s in by_rank if s.rank in asked)
                return self.fail(late, f"it was still running {FOLLOW_SECONDS:.0f} s after rank "
                                       f"{min(codes)} ended")
            time.sleep(POLL_SECONDS)

    def fail(self, slot: Slot, why: str, code: int = 1) -> int:
        print(f"hvdtrain ray: {self.where(slot)} failed: {why}; ending the job", file=sys.stderr, flush=True)
        return code if code > 0 else 1

    def release(self) -> None:
        """Every rank killed, every actor and the placement group released, the rendezvous stopped."""
        try:
            import ray
        except ImportError:
            return
        if not ray.is_initialized():
            return
        kills = []
        for actor in self.actors:
            try:
                kills.append(actor.kill.remote())
            except Exception:  # an actor already gone
                pass
        try:
            ray.wait(kills, num_returns=len(kills), timeout=15)
        except Exception:
            pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        if self.placement_group is not None:
            try:
                ray.util.remove_placement_group(self.placement_group)
            except Exception:
                pass
        if self.rendezvous is not None:
            self.rendezvous.stop()
        ray.shutdown()


def rendezvous_class():
    import hmac
    import http.server
    import secrets

    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer, RendezvousServer
    from horovod.runner.util.threads import in_thread

    class TokenHandler(RendezvousHandler):
        """Horovod's handler behind the job's token. Gloo's HTTP store (C++) builds its URLs as
        http://ADDR:PORT/SCOPE/KEY from HOROVOD_GLOO_RENDEZVOUS_ADDR, so ADDR = IP:PORT/TOKEN makes
        every request's path /TOKEN:PORT/SCOPE/KEY: the first segment is checked and dropped, and a
        request without the token (an outsider's PUT of a peer address) is refused with 403."""

        def parse_request(self) -> bool:
            # The check of Horovod's own handler (this repository's patch, item 7) is bypassed: it
            # would strip the token a second time. Stock Horovod's handler has none.
            if not http.server.BaseHTTPRequestHandler.parse_request(self):
                return False
            first, _, rest = self.path.lstrip("/").partition("/")
            if not hmac.compare_digest(first.partition(":")[0].encode(), self.server.token.encode()):
                self.send_status_code(403)
                return False
            self.path = "/" + rest
            return True

        def do_HEAD(self):  # SimpleHTTPRequestHandler would list the working directory
            self.send_status_code(403)

    class FixedPortRendezvous(RendezvousServer):
        """Horovod's rendezvous server on an address and port of our choosing, behind a token: its
        start() binds every interface on a random port between 1024 and 65535, which a firewalled
        cluster (or a test confined to a port range) cannot open, and takes writes from anyone.
        The same two steps as RendezvousServer.start, then init(plan) and stop() unchanged."""

        def start_on(self, port: int, address: str = "", token: str = "") -> int:
            self._httpd = RendezvousHTTPServer((address, port), TokenHandler, self._verbose)
            self._httpd.token = token or secrets.token_hex(16)
            self._listen_thread = in_thread(target=self._httpd.serve_forever)
            return self._httpd.server_address[1]

        @property
        def token(self) -> str:
            return self._httpd.token

    return FixedPortRendezvous


def Rendezvous():  # noqa: N802 - a class made on first use: Horovod's runner is imported only here
    return rendezvous_class()()


def rendezvous_addr(addr: str, port: int, token: str) -> str:
    """HOROVOD_GLOO_RENDEZVOUS_ADDR carrying the token (see TokenHandler); the ranks read it from
    their environment, never from a command line."""
    return f"{addr}:{port}/{token}"


def start_rendezvous(port: int, addr: str) -> tuple[Any, int]:
    """The job's rendezvous server, listening on ``addr`` (the address the ranks reach it at) only,
    and its port."""
    rendezvous = Rendezvous()
    try:
        return rendezvous, rendezvous.start_on(port, addr)
    except OSError as error:
        raise RayLaunchError(f"cannot listen on {addr}:{port} for Horovod's rendezvous ({error.strerror}): give "
                             f"--rendezvous-addr an address of this machine and a free --rendezvous-port") from None


def main(argv: list[str]) -> int:
    try:
        options = parse_args(argv)
        if options.program[0] == "-m":
            check_train_args(options.program[3:])
        try:
            import ray  # noqa: F401
        except ImportError:
            raise RayLaunchError(INSTALL_HINT) from None
        return Job(options).run()
    except RayLaunchError as error:
        print(f"hvdtrain ray: error: {error}", file=sys.stderr, flush=True)
        return 2
