"""Experiment tracking: the run sent to Weights & Biases and/or an MLflow tracking server, from rank 0.

What is sent (x axis: the global optimizer step everywhere):

* at start: the resolved config, flattened (``train.epochs``...), as W&B config / MLflow params,
  and the environment (world size, hosts, hvdtrain/torch/Horovod versions, git commit) as
  W&B config ``env`` / MLflow tags ``hvdtrain.*``;
* every ``tracking.every_steps`` steps: ``train_step/loss`` (and the task's other metrics) of rank
  0's share of the steps since the last point, ``train_step/lr`` and ``train_step/samples_per_sec``
  (all ranks);
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
import math
import os
import queue
import random
import multiprocessing
import shutil
import signal
import socket
import string
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import psutil

from .config import Config, ConfigError, to_dict

QUEUE_SIZE = 1000
ID_WAIT_SECONDS = 10.0        # a checkpoint written while a run is still being created waits this long for its id
# MLflow's HTTP client retries for minutes by default; a tracker must give up quickly (users may override).
MLFLOW_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}  # the start-up line names the run
STEP_KEY = "train_step/loss"  # MLflow: the highest step already sent is read back from this metric on resume


def enabled(cfg: Config) -> list[str]:
    return [name for name in ("wandb", "mlflow") if getattr(cfg.tracking, name).enabled]


def require_packages(cfg: Config) -> None:
    """Stop with one line when an enabled tracker is not installed (on every rank, importing nothing)."""
    for name in enabled(cfg):
        if importlib.util.find_spec(name) is None:
            raise ConfigError(f"tracking.{name}.enabled=true needs the {name} package: pip install -e .[{name}] "
                              f"(or make setup EXTRAS={name})")


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"train": {"epochs": 3}}`` -> ``{"train.epochs": 3}``."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def epoch_values(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of one metrics.jsonl record, named as in tensorboard (``val/top1``)."""
    split = record["split"]
    values = {f"{split}/{key}": value for key, value in record.items()
              if key not in ("split", "epoch", "step") and isinstance(value, (int, float))
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
        return {name: dict(ids) for name, ids in self.ids.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ids = {name: dict(ids) for name, ids in state.items()}


def environment(hosts: list[str]) -> dict[str, Any]:
    import torch

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return ""

    from . import __version__, dist

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


def new_wandb_id() -> str:
    """An id of W&B's form (8 lowercase letters and digits), chosen here so it is known at once."""
    return "".join(random.SystemRandom().choices(string.ascii_lowercase + string.digits, k=8))


# --- backends (they run in the sender only) -----------------------------------------------------

class Backend:
    name = ""

    def start(self, ids: dict[str, str], params: dict[str, Any], env: dict[str, Any]) -> tuple[dict[str, str], str]:
        """Create or resume the run; returns its ids and a short description for the start-up line."""
        raise NotImplementedError

    def last_step(self) -> int:
        """The highest step the tracker already has step-level values for (-1: none or unknown)."""
        return -1

    def log(self, batch: list[tuple[int, float, dict[str, float]]]) -> None:
        """(step, unix time, values) entries, in step order."""
        raise NotImplementedError

    def artifact(self, path: Path, name: str) -> None:
        raise NotImplementedError

    def finish(self, status: str) -> None:
        """status: finished, preempted or failed."""
        raise NotImplementedError


class WandbBackend(Backend):
    name = "wandb"

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.run: Any = None

    def start(self, ids, params, env):
        import wandb

        options = self.cfg.tracking.wandb
        resumed = bool(ids.get("id"))
        run_id = ids.get("id") or new_wandb_id()
        # W&B's own system monitor is off: hvdtrain measures CPU/GPU per rank itself (metrics.jsonl).
        settings = wandb.Settings(console="off", silent=True, x_disable_stats=True, save_code=False,
                                  x_save_requirements=False, init_timeout=60)
        self.run = wandb.init(project=options.project, entity=options.entity or None,
                              name=options.name or self.run_dir.resolve().name,
                              tags=[t.strip() for t in options.tags.split(",") if t.strip()] or None,
                              id=run_id, resume="allow", dir=str(self.run_dir), mode=options.mode,
                              config={**params, "env": env}, settings=settings, allow_val_change=True)
        where = f"offline under {self.run_dir / 'wandb'}" if options.mode == "offline" else f"project {options.project}"
        return {"id": run_id}, f"wandb run {run_id} ({'resumed, ' if resumed else ''}{where})"

    def log(self, batch):
        for step, _, values in batch:
            self.run.log(values, step=step)

    def artifact(self, path, name):
        import wandb

        artifact = wandb.Artifact(f"{self.run.id}-checkpoint", type="model")
        artifact.add_file(str(path), name=f"{name}.pt")
        self.run.log_artifact(artifact, aliases=[name])

    def finish(self, status):
        self.run.finish(exit_code={"finished": 0, "preempted": 75}.get(status, 1))


class MlflowBackend(Backend):
    name = "mlflow"

    def __init__(self, cfg: Config, run_dir: Path):
        self.cfg, self.run_dir = cfg, run_dir
        self.client: Any = None
        self.run_id = ""

    def start(self, ids, params, env):
        for key, value in MLFLOW_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        import mlflow
        from mlflow.entities import Param, RunTag
        from mlflow.tracking import MlflowClient

        options = self.cfg.tracking.mlflow
        uri = options.tracking_uri or mlflow.get_tracking_uri()
        self.client = MlflowClient(tracking_uri=uri)
        tags = [RunTag(f"hvdtrain.{key}", str(value)) for key, value in env.items()]
        if env["git_commit"]:
            tags.append(RunTag("mlflow.source.git.commit", env["git_commit"]))
        params = {key: str(value) for key, value in params.items()}
        note = ""
        if ids.get("run_id") and ids.get("tracking_uri") != uri:
            note = f"; the checkpoint's run {ids['run_id']} is on {ids.get('tracking_uri')}: new run"
        elif ids.get("run_id"):
            try:
                run = self.client.get_run(ids["run_id"])
            except Exception as error:  # deleted, or another server behind the same address
                note = f"; the checkpoint's run {ids['run_id']} is not there ({first_line(error)}): new run"
            else:
                self.run_id = run.info.run_id
                self.client.update_run(self.run_id, status="RUNNING")
                known = run.data.params
                changed = sorted(k for k, v in params.items() if k in known and known[k] != v)
                # MLflow params cannot change: what changed at resume goes to tags.
                tags += [RunTag(f"hvdtrain.resumed_with.{k}", params[k]) for k in changed]
                params = {k: v for k, v in params.items() if k not in known}
        if not self.run_id:
            experiment = self.client.get_experiment_by_name(options.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(options.experiment))
            self.run_id = self.client.create_run(experiment_id, run_name=options.run_name or self.run_dir.resolve().name
                                                 ).info.run_id
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, max(len(items), 1), 100):  # the server takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[start:start + 100], tags=tags if start == 0 else [])
        resumed = self.run_id == ids.get("run_id")
        return ({"run_id": self.run_id, "tracking_uri": uri},
                f"mlflow run {self.run_id} ({'resumed, ' if resumed else ''}{uri}){note}")

    def last_step(self):
        history = self.client.get_metric_history(self.run_id, STEP_KEY)
        return max((m.step for m in history), default=-1)

    def log(self, batch):
        from mlflow.entities import Metric

        metrics = [Metric(key, float(value), int(stamp * 1000), step)
                   for step, stamp, values in batch for key, value in values.items()]
        for start in range(0, len(metrics), 1000):  # the server's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def artifact(self, path, name):
        self.client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")

    def finish(self, status):
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))


BACKENDS: dict[str, Callable[[Config, Path], Backend]] = {"wandb": WandbBackend, "mlflow": MlflowBackend}


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return (f"{type(error).__name__}: {text[0]}" if text else type(error).__name__)[:200]


# --- the tracker (rank 0) ----------------------------------------------------------------------

class Sender:
    """The trackers' side: imports their libraries, creates or resumes the runs, sends the values the
    relay hands over, ends the runs. It runs in a process of its own (``serve``), so the training
    process never imports wandb or mlflow nor runs their threads; tests that swap in a backend of
    their own run it on a thread instead.

    Messages to the relay: ``("log", line)``, ``("ids", backend, ids)``, ``("ready", skip_through)``
    once the runs exist, and ``("done", failed sends per backend, CPU seconds after start-up, values
    sent, helper-process CPU line)`` at the end. From the relay: ``("log", [(step, time, values),
    ...])``, ``("artifact", path, kind)``, ``("finish", status)``."""

    def __init__(self, cfg: Config, run_dir: Path, names: list[str], inbox: Connection, outbox: Connection):
        self.backends = [BACKENDS[name](cfg, run_dir) for name in names]
        self.inbox, self.outbox = inbox, outbox
        self.failed: dict[str, int] = {}

    def run(self, ids: dict[str, dict[str, str]], params: dict[str, Any], env: dict[str, Any],
            parent: int | None, clock: Callable[[], float]) -> None:
        live: list[Backend] = []
        skip_through = -1
        for backend in self.backends:
            try:
                got, description = backend.start(ids.get(backend.name, {}), params, env)
                skip_through = max(skip_through, backend.last_step())
            except Exception as error:
                self.outbox.send(("log", f"hvdtrain: warning: tracking with {backend.name} is off for this run: "
                                         f"{first_line(error)}"))
                continue
            live.append(backend)
            self.failed[backend.name] = 0
            self.outbox.send(("ids", backend.name, got))
            self.outbox.send(("log", f"hvdtrain: tracking: {description}"))
        self.outbox.send(("ready", skip_through))
        began, sent = clock(), 0
        while True:
            try:
                if not self.inbox.poll(1.0):
                    if parent is not None and os.getppid() != parent:
                        return  # the training process is gone (killed): nothing more will come
                    continue
                item = self.inbox.recv()
            except (EOFError, OSError):
                return
            if item[0] == "finish":
                break
            if item[0] == "artifact":
                _, path, kind = item
                self.send(live, lambda backend: backend.artifact(path, kind))
                shutil.rmtree(path.parent, ignore_errors=True)
                continue
            batch = item[1]
            self.send(live, lambda backend: backend.log(batch))
            sent += len(batch)
        cpu, helpers = clock() - began, helper_cpu()
        for backend in live:
            try:
                backend.finish(item[1])
            except Exception as error:
                self.failed[backend.name] += 1
                self.outbox.send(("log", f"hvdtrain: warning: tracking: ending the {backend.name} run failed: "
                                         f"{first_line(error)}"))
        self.outbox.send(("done", self.failed, cpu, sent, helpers))

    def send(self, live: list[Backend], action: Callable[[Backend], None]) -> None:
        for backend in live:
            try:
                action(backend)
            except Exception as error:
                self.failed[backend.name] += 1
                if self.failed[backend.name] == 1:  # once; the closing line has the count
                    self.outbox.send(("log", f"hvdtrain: warning: tracking: sending to {backend.name} failed, "
                                             f"training goes on: {first_line(error)}"))


def serve(read_fd: int, write_fd: int) -> None:
    """The sender process (``python -c "from hvdtrain.tracking import serve; ..."``)."""
    # The job's stop signals (a scheduler signals every process of the job) are the training
    # process's to handle: it asks this process to end the runs with the right status.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    cfg, run_dir, names, ids, params, env = inbox.recv()
    Sender(cfg, run_dir, names, inbox, outbox).run(ids, params, env, os.getppid(), time.process_time)


class Tracker:
    """Rank 0's link to the trackers. The training thread queues references; a relay thread turns
    them into plain values (the task's arithmetic, which may wait for the GPU) and passes them over
    a pipe to the sender process, which talks to the trackers."""

    def __init__(self, cfg: Config, run_dir: Path, state: TrackingState, hosts: list[str],
                 log: Callable[[str], None], names: list[str] | None = None, in_process: bool = False):
        self.cfg, self.run_dir, self.state, self.log = cfg, run_dir, state, log
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
        staged.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, staged)
        except OSError:
            shutil.copyfile(path, staged)
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
                [sys.executable, "-c", "import sys; from hvdtrain.tracking import serve; "
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
            params = flatten(to_dict(self.cfg))
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
                writer.send(item)
                continue
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
            try:
                if kept:
                    writer.send(("log", kept))
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
    values = {f"train_step/{key}": value for key, value in summarize(local - mark_sums).items()
              if key != "samples" and isinstance(value, (int, float)) and math.isfinite(value)}
    values.update({"train_step/lr": lr, "train_step/samples_per_sec": samples_per_sec})
    return step, stamp, values


def helper_cpu() -> str:
    """The CPU time so far of the trackers' helper processes (W&B's ``wandb-core``), which run beside
    the training process on its machine."""
    try:
        seconds = sum(sum(child.cpu_times()[:2]) for child in psutil.Process().children(recursive=True)
                      if "wandb" in child.name())
    except psutil.Error:  # gone meanwhile: nothing to report
        return ""
    return f"; wandb-core {seconds:.2f} s CPU so far" if seconds else ""


def close_status() -> str:
    """How the run ends, from the exception in flight (called from a ``finally``)."""
    error = sys.exc_info()[1]
    if error is None:
        return "finished"
    return "preempted" if type(error).__name__ == "Preempted" else "failed"
