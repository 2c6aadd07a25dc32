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

A tracker never stops training: the libraries are imported, runs started and values sent on one
background thread behind a bounded queue (full: the value is dropped and counted); an unreachable or
misconfigured tracker costs one warning line and is left out for the rest of the run; the training
thread only builds a small dict every ``every_steps`` steps. Other ranks never import the trackers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import math
import os
import queue
import random
import shutil
import socket
import string
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

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


# --- backends (they run on the tracker's thread only) ------------------------------------------

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

class Tracker:
    """Rank 0's link to the trackers: the training thread queues, one background thread sends."""

    def __init__(self, cfg: Config, run_dir: Path, state: TrackingState, hosts: list[str],
                 log: Callable[[str], None], names: list[str] | None = None):
        self.cfg, self.run_dir, self.state, self.log = cfg, run_dir, state, log
        self.every = cfg.tracking.every_steps
        self.backends = [BACKENDS[name](cfg, run_dir) for name in (names or enabled(cfg))]
        self.queue: queue.Queue = queue.Queue(QUEUE_SIZE)
        self.dropped = 0            # values the full queue refused
        self.failed: dict[str, int] = {}   # sends that raised, per backend (after a successful start)
        self.skipped = 0            # step-level points a resumed run had already sent before a crash
        self.hook_seconds = 0.0     # time the training thread spent in this class (the per-step cost)
        self.hook_calls = 0
        self.mark: tuple[int, float, Any] | None = None  # (step, time, rank 0's sums) at the last point
        self.last_point = -1        # the step of the last step-level point queued
        self.staging = run_dir / "tracking-staging"
        self.artifacts = 0
        state.starting = threading.Event()
        self.hosts = hosts
        self.thread = threading.Thread(target=self.work, name="hvdtrain-tracking", daemon=True)
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
        arithmetic happens on the tracker's thread."""
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
        problems = [f"{n} sends to {name} failed" for name, n in self.failed.items() if n]
        if self.dropped:
            problems.append(f"{self.dropped} values dropped (queue full)")
        if lost:
            problems.append(f"{lost} entries not sent within {flush:g} s (tracking.flush_seconds)")
        if self.skipped:
            problems.append(f"{self.skipped} step-level points not sent again (sent before an interruption)")
        cost = f"{1e6 * self.hook_seconds / self.hook_calls:.0f} us per point" if self.hook_calls else "none"
        self.log(f"hvdtrain: tracking: training-thread cost {cost}"
                 + (f"; {'; '.join(problems)}" if problems else ""))
        shutil.rmtree(self.staging, ignore_errors=True)

    # background thread ---------------------------------------------------------------------------

    def work(self) -> None:
        live: list[Backend] = []
        skip_through = -1
        try:
            params = flatten(to_dict(self.cfg))
            env = environment(self.hosts)
            for backend in self.backends:
                try:
                    ids, description = backend.start(self.state.ids.get(backend.name, {}), params, env)
                    self.state.ids[backend.name] = ids
                    skip_through = max(skip_through, backend.last_step())
                except Exception as error:
                    self.log(f"hvdtrain: warning: tracking with {backend.name} is off for this run: "
                             f"{first_line(error)}")
                    continue
                live.append(backend)
                self.failed[backend.name] = 0
                self.log(f"hvdtrain: tracking: {description}")
        finally:
            if self.state.starting is not None:
                self.state.starting.set()
        held = None  # an artifact or the end, met while gathering a batch: handled next
        while True:
            item, held = (held, None) if held is not None else (self.queue.get(), None)
            if item[0] == "finish":
                break
            if item[0] == "artifact":
                _, path, kind = item
                self.send(live, lambda backend: backend.artifact(path, kind))
                shutil.rmtree(path.parent, ignore_errors=True)
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
            if kept:
                self.send(live, lambda backend: backend.log(kept))
        status = item[1]
        for backend in live:
            try:
                backend.finish(status)
            except Exception as error:
                self.failed[backend.name] += 1
                self.log(f"hvdtrain: warning: tracking: ending the {backend.name} run failed: {first_line(error)}")

    def send(self, live: list[Backend], action: Callable[[Backend], None]) -> None:
        for backend in live:
            try:
                action(backend)
            except Exception as error:
                self.failed[backend.name] += 1
                if self.failed[backend.name] == 1:  # once; close() reports the count
                    self.log(f"hvdtrain: warning: tracking: sending to {backend.name} failed, training goes on: "
                             f"{first_line(error)}")


def entry(item: tuple) -> tuple[int, float, dict[str, float]]:
    """A queued ``log`` or step-level ``point`` as (step, unix time, values)."""
    if item[0] == "log":
        return item[1], item[2], item[3]
    _, step, stamp, local, mark_sums, summarize, lr, samples_per_sec = item
    values = {f"train_step/{key}": value for key, value in summarize(local - mark_sums).items()
              if key != "samples" and isinstance(value, (int, float)) and math.isfinite(value)}
    values.update({"train_step/lr": lr, "train_step/samples_per_sec": samples_per_sec})
    return step, stamp, values


def close_status() -> str:
    """How the run ends, from the exception in flight (called from a ``finally``)."""
    error = sys.exc_info()[1]
    if error is None:
        return "finished"
    return "preempted" if type(error).__name__ == "Preempted" else "failed"
