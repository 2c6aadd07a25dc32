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
   handler (fault/preemption.py) in its main thread, and a crash (a Gloo segfault) must end one rank
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

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

from .ray_plan import (
    ANSWER_SECONDS,
    EXIT_PREEMPTED,
    FOLLOW_SECONDS,
    INSTALL_HINT,
    POLL_SECONDS,
    Options,
    Placement,
    RayLaunchError,
    Slot,
    assign_ranks,
    check_train_args,
    describe_exit,
    host_names,
    interface_of,
    node_gpus,
    parse_args,
    rank_env,
)
from .ray_rendezvous import rendezvous_addr, start_rendezvous

__all__ = ["main", "Job", "RankActor", "Placement", "Slot", "RayLaunchError", "assign_ranks", "describe_exit",
           "host_names", "node_gpus", "rank_env", "rendezvous_addr", "start_rendezvous"]
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
