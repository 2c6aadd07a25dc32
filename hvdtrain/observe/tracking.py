"""Experiment tracking: the run sent to Weights & Biases and/or an MLflow tracking server, from rank 0.

What is sent (x axis: the global optimizer step everywhere):

* at start: the resolved config, flattened (``train.epochs``...), as W&B config / MLflow params,
  and the environment (world size, hosts, hvdtrain/torch/Horovod versions, git commit) as
  W&B config ``env`` / MLflow tags ``hvdtrain.*``;
* every ``tracking.every_steps`` steps: ``train_step/loss`` (and the task's other metrics) of rank
  0's share of the steps since the last point, ``train_step/lr`` and ``train_step/samples_per_sec``
  (all ranks): the values TensorBoard gets too (observe/metrics.py, ``step_values``);
* every epoch record of metrics.jsonl, numeric values only, as ``train/<key>`` and ``val/<key>``
  (the names of tensorboard's scalars) with ``epoch``, at the step the record carries;
* checkpoints as artifacts (``tracking.log_checkpoints``).

One tracked run per training: the trackers' run ids are a component of the run state
(``TrackingState``, registered as ``tracking``), so checkpoints carry them and a resumed run
(preemption, crash, elastic reset) continues the same W&B run (``id`` + ``resume``) and the same
MLflow run (``run_id``).

A tracker never stops training: the training thread only queues references every ``every_steps``
steps, behind a bounded queue (full: the value is dropped and counted); a relay thread turns them
into values and hands them to a sender process, which imports the trackers' libraries, starts the
runs and sends. Neither wandb nor mlflow is imported into the training process (importing mlflow
alone moved a CPU step by up to 5%), and their threads never take its GIL. An unreachable or
misconfigured tracker costs one warning line and is left out for the rest of the run. Other ranks
never import the trackers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import multiprocessing
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from ..config import Config, ConfigError, flatten, to_dict
from ..ownership import own_folder
from ..redact import has_password, mask_values
from .metrics import step_values
from .tracking_sender import STEP_KEY, Sender, first_line

QUEUE_SIZE = 1000
ID_WAIT_SECONDS = 10.0        # a checkpoint written while a run is still being created waits this long for its id


def enabled(cfg: Config) -> list[str]:
    return [name for name in ("wandb", "mlflow") if getattr(cfg.tracking, name).enabled]


def require_packages(cfg: Config) -> None:
    """Stop with one line when an enabled tracker is not installed (on every rank, importing nothing)."""
    for name in enabled(cfg):
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"tracking.{name}.enabled=true needs the {name} package: pip install -e .[{name}] "
                              f"(or make setup EXTRAS={name})")


def epoch_values(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of one metrics.jsonl record, named as in tensorboard (``val/top1``). The
    job and attempt that wrote the record name it; they are not series."""
    split = record["split"]
    values = {f"{split}/{key}": value for key, value in record.items()
              if key not in ("split", "epoch", "step", "job", "attempt") and isinstance(value, (int, float))
              and not isinstance(value, bool)}
    if split == "train":  # once per epoch record pair
        values["epoch"] = record["epoch"]
    return values


class TrackingState:
    """The trackers' run ids, as a run-state component: ``{"wandb": {"id": ...}, "mlflow": {"run_id":
    ..., "tracking_uri": ...}}``. While a tracker is still creating its run, ``state_dict`` waits for
    it (at most ``ID_WAIT_SECONDS``) so that the first checkpoint already names the run."""

    def __init__(self) -> None:
        self.ids: dict[str, dict[str, str]] = {}
        self.starting: threading.Event | None = None

    def state_dict(self) -> dict[str, Any]:
        if self.starting is not None and not self.starting.is_set():
            self.starting.wait(ID_WAIT_SECONDS)
        return {name: mask_values(dict(ids)) for name, ids in self.ids.items()}  # no password in checkpoints

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ids = {name: dict(ids) for name, ids in state.items()}


def environment(hosts: list[str]) -> dict[str, Any]:
    import torch

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return ""

    from .. import __version__
    from ..comm import dist

    return {"world_size": dist.size(), "hosts": ",".join(hosts) or socket.gethostname(),
            "hvdtrain_version": __version__, "torch_version": torch.__version__,
            "horovod_version": version("horovod"), "python_version": sys.version.split()[0],
            "git_commit": git_commit()}


def git_commit() -> str:
    """The commit of the hvdtrain code that runs, when it is a git checkout ("" otherwise)."""
    try:
        found = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                               text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return ""
    return found.stdout.strip() if found.returncode == 0 else ""


class Tracker:
    """Rank 0's link to the trackers. The training thread queues references; a relay thread turns
    them into plain values (the task's arithmetic, which may wait for the GPU) and passes them over
    a pipe to the sender process, which talks to the trackers."""

    def __init__(self, cfg: Config, run_dir: Path, state: TrackingState, hosts: list[str],
                 log: Callable[[str], None], names: list[str] | None = None, in_process: bool = False,
                 resume: dict[str, Any] | None = None):
        self.cfg, self.run_dir, self.state, self.log = cfg, run_dir, state, log
        # What changed at this resume (run.resume_changes, with the step): a parameter of its own,
        # resumed_at_step_N, so that every resume through a change stays on the tracker's record
        # (MLflow keeps params, W&B merges config keys) beside the values the run now has.
        self.resume = resume
        self.every = cfg.tracking.every_steps
        self.names = names or enabled(cfg)
        self.in_process = in_process  # the sender on a thread (tests with backends of their own)
        self.sender: Sender | None = None
        self.process: subprocess.Popen | None = None
        self.queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.dropped = 0            # values the full queue refused
        self.failed: dict[str, int] = {}   # sends that raised, per backend (after a successful start)
        self.skipped = 0            # step-level points a resumed run had already sent before a crash
        self.hook_seconds = 0.0     # time the training thread spent in this class (the per-step cost)
        self.hook_calls = 0
        self.sender_cpu = ""        # the sender's CPU time per value sent, for the closing line
        self.mark: tuple[int, float, Any] | None = None  # (step, time, rank 0's sums) at the last point
        self.last_point = -1        # the step of the last step-level point queued
        self.staging = run_dir / "tracking-staging"
        self.artifacts = 0
        state.starting = threading.Event()
        self.hosts = hosts
        if "mlflow" in self.names and has_password(cfg.tracking.mlflow.tracking_uri):
            log("hvdtrain: warning: tracking.mlflow.tracking_uri holds a password: hvdtrain writes it as ***, but "
                "the command line (ps) or the config file that gave it shows it; set MLFLOW_TRACKING_USERNAME "
                "and MLFLOW_TRACKING_PASSWORD in the environment instead (docs/tracking.md)")
        self.thread = threading.Thread(target=self.relay, name="hvdtrain-tracking", daemon=True)
        self.thread.start()

    # training thread -----------------------------------------------------------------------------

    def put(self, item: tuple) -> None:
        try:
            self.queue.put_nowait(item)
        except queue.Full:
            self.dropped += 1

    def start_epoch(self, step: int, sums: Any) -> None:
        self.mark = (step, time.perf_counter(), sums.local())

    def after_step(self, step: int, sums: Any, summarize: Callable, lr: float, global_batch: int) -> None:
        """Every ``every_steps`` steps: rank 0's mean of the task's metrics since the last point, the
        learning rate of the last step and the images/s of all ranks. Only references are taken
        here (``MetricSums`` replaces its tensor at every add, never changes it in place); the
        arithmetic happens on the relay thread."""
        if not self.every or step % self.every or self.mark is None:
            return
        if step <= self.last_point:  # an elastic rollback trains these steps again: sent already
            self.skipped += 1
            return
        self.last_point = step
        began = time.perf_counter()
        local = sums.local()
        mark_step, mark_time, mark_sums = self.mark
        self.put(("point", step, time.time(), local, mark_sums, summarize, lr,
                  (step - mark_step) * global_batch / max(began - mark_time, 1e-9)))
        self.mark = (step, began, local)
        self.hook_seconds += time.perf_counter() - began
        self.hook_calls += 1

    def epoch(self, record: dict[str, Any]) -> None:
        began = time.perf_counter()
        self.put(("log", record["step"], time.time(), epoch_values(record)))
        self.hook_seconds += time.perf_counter() - began

    def checkpoint(self, path: Path | None, is_best: bool) -> None:
        """Queue a checkpoint upload; a hard link keeps this very file until it is sent (the saver
        may prune or replace it meanwhile)."""
        kind = self.cfg.tracking.log_checkpoints
        if path is None or kind == "none" or (kind == "best" and not is_best):
            return
        self.artifacts += 1
        staged = self.staging / str(self.artifacts) / f"{kind}.pt"
        # In the checked run folder, held to its rule (hvdtrain/ownership.py); a name left there by an
        # earlier run is replaced, and a copy is made with O_EXCL: never written through a link.
        own_folder(staged.parent, self.cfg.output.share, what="tracking staging folder")
        if os.path.lexists(staged):
            os.unlink(staged)
        try:
            os.link(path, staged)
        except OSError:
            with open(path, "rb") as source, open(staged, "xb") as copy:
                shutil.copyfileobj(source, copy)
        self.put(("artifact", staged, kind))

    def close(self, status: str) -> None:
        """Send what is queued and end the runs, waiting at most ``tracking.flush_seconds`` in all."""
        flush = self.cfg.tracking.flush_seconds
        deadline = time.monotonic() + flush
        try:
            self.queue.put(("finish", status), timeout=flush)
        except queue.Full:
            self.dropped += 1
        self.thread.join(max(0.0, deadline - time.monotonic()))
        lost = self.queue.qsize() + 1 if self.thread.is_alive() else 0
        if self.process is not None and self.process.poll() is None:
            if lost:
                self.process.kill()  # a tracker that hangs must not hold the end of training
            try:
                self.process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.process.kill()
        problems = [f"{n} sends to {name} failed" for name, n in self.failed.items() if n]
        if self.dropped:
            problems.append(f"{self.dropped} values dropped (queue full)")
        if lost:
            problems.append(f"{lost} entries not sent within {flush:g} s (tracking.flush_seconds)")
        if self.skipped:
            problems.append(f"{self.skipped} step-level points not sent again (sent before an interruption)")
        cost = f"{1e6 * self.hook_seconds / self.hook_calls:.0f} us per point" if self.hook_calls else "none"
        self.log(f"hvdtrain: tracking: training-thread cost {cost}{self.sender_cpu}"
                 + (f"; {'; '.join(problems)}" if problems else ""))
        shutil.rmtree(self.staging, ignore_errors=True)

    # relay thread --------------------------------------------------------------------------------

    def start_sender(self, params: dict[str, Any], env: dict[str, Any]) -> tuple[Connection, Connection]:
        """The sender, and the pipe ends to talk to it: (to the sender, from the sender)."""
        ids = {name: dict(value) for name, value in self.state.ids.items()}
        if self.in_process:
            inbox, to_sender = multiprocessing.Pipe(duplex=False)
            from_sender, outbox = multiprocessing.Pipe(duplex=False)
            self.sender = Sender(self.cfg, self.run_dir, self.names, inbox, outbox)
            threading.Thread(target=self.sender.run, args=(ids, params, env, None, time.thread_time),
                             name="hvdtrain-tracking-sender", daemon=True).start()
            return to_sender, from_sender
        inbox, to_sender = os.pipe()
        from_sender, outbox = os.pipe()
        package_root = str(Path(__file__).resolve().parents[1])
        python_path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", "import sys; from hvdtrain.observe.tracking_sender import serve; "
                 "serve(int(sys.argv[1]), int(sys.argv[2]))", str(inbox), str(outbox)],
                pass_fds=(inbox, outbox), stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": python_path})
        finally:
            os.close(inbox)
            os.close(outbox)
        writer, reader = Connection(to_sender, readable=False), Connection(from_sender, writable=False)
        writer.send((self.cfg, self.run_dir, self.names, ids, params, env))
        return writer, reader

    def pump(self, reader: Connection, until: str | None = None) -> tuple | None:
        """Handle the sender's messages: those waiting, or all up to the first ``until`` message."""
        while until is not None or reader.poll():
            message = reader.recv()  # EOFError when the sender died: the caller stops
            if message[0] == "log":
                self.log(message[1])
            elif message[0] == "ids":
                self.state.ids[message[1]] = message[2]
            elif message[0] == "done":
                self.failed, cpu, sent, helpers = message[1:]
                if sent:
                    where = "sender thread" if self.in_process else "sender process"
                    self.sender_cpu = f"; {where} {1e6 * cpu / sent:.0f} us CPU per value ({sent} values){helpers}"
            if message[0] == until:
                return message
        return None

    def relay(self) -> None:
        writer: Connection | None = None
        skip_through = -1
        try:
            params = flatten(mask_values(to_dict(self.cfg)))  # W&B config, MLflow params: no password
            if self.resume:
                changes = {key: value for key, value in self.resume.items() if key != "step"}
                params[f"resumed_at_step_{self.resume['step']}"] = json.dumps(mask_values(changes), sort_keys=True)
            env = environment(self.hosts)
            writer, reader = self.start_sender(params, env)
            skip_through = self.pump(reader, until="ready")[1]
        except EOFError:  # the sender died starting (its own error is on stderr): training goes on
            code = self.process.wait() if self.process is not None else None
            self.log(f"hvdtrain: warning: tracking is off for this run: its sender process ended at start "
                     f"(exit code {code})")
            writer = None
        except Exception as error:
            self.log(f"hvdtrain: warning: tracking is off for this run: {first_line(error)}")
            writer = None
        finally:
            if self.state.starting is not None:
                self.state.starting.set()
        held = None  # an artifact or the end, met while gathering a batch: handled next
        while True:
            item, held = (held, None) if held is not None else (self.queue.get(), None)
            if item[0] == "finish":
                break
            if writer is None:
                continue  # nothing to send to: the queue is drained so that close() does not wait
            if item[0] == "artifact":
                message = item
            else:
                batch = [entry(item)]
                while len(batch) < 100:  # send what has piled up in one request
                    try:
                        following = self.queue.get_nowait()
                    except queue.Empty:
                        break
                    if following[0] not in ("log", "point"):
                        held = following
                        break
                    batch.append(entry(following))
                # After a crash, the steps between the last checkpoint and the crash are trained again
                # (identically): the tracker keeps the values it got the first time.
                kept = [entry for entry in batch if not (entry[0] <= skip_through and STEP_KEY in entry[2])]
                self.skipped += len(batch) - len(kept)
                message = ("log", kept) if kept else None
            try:  # an artifact too: a sender that died must not take the relay with it
                if message is not None:
                    writer.send(message)
                self.pump(reader)
            except (EOFError, OSError):
                self.log("hvdtrain: warning: tracking: the sender process ended; training goes on untracked")
                writer = None
        if writer is not None:
            try:
                writer.send(("finish", item[1]))
                self.pump(reader, until="done")
            except (EOFError, OSError):
                self.log("hvdtrain: warning: tracking: the sender process ended before the runs did")


def entry(item: tuple) -> tuple[int, float, dict[str, float]]:
    """A queued ``log`` or step-level ``point`` as (step, unix time, values)."""
    if item[0] == "log":
        return item[1], item[2], item[3]
    _, step, stamp, local, mark_sums, summarize, lr, samples_per_sec = item
    return step, stamp, step_values(local, mark_sums, summarize, lr, samples_per_sec)


def close_status() -> str:
    """How the run ends, from the exception in flight (called from a ``finally``)."""
    error = sys.exc_info()[1]
    if error is None:
        return "finished"
    return "preempted" if type(error).__name__ == "Preempted" else "failed"
