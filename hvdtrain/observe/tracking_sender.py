"""The trackers' side of experiment tracking: the W&B and MLflow backends and the sender process
that runs them (``serve``), so that the training process never imports either library. The
training side (what is sent, when, and the relay to this process) is ``hvdtrain.observe.tracking``."""

from __future__ import annotations

import os
import random
import shutil
import signal
import string
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

import psutil

from ..config import Config
from ..redact import MASK, mask_text, split_credentials, without_credentials

# MLflow's HTTP client retries for minutes by default; a tracker must give up quickly (users may override).
MLFLOW_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
                       "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                       "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true"}  # the start-up line names the run
STEP_KEY = "train_step/loss"  # MLflow: the highest step already sent is read back from this metric on resume


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
        self.client = MlflowClient(tracking_uri=use_credentials(uri))
        shown = mask_text(uri)  # what the start-up line and the checkpoints' run ids say
        tags = [RunTag(f"hvdtrain.{key}", str(value)) for key, value in env.items()]
        if env["git_commit"]:
            tags.append(RunTag("mlflow.source.git.commit", env["git_commit"]))
        params = {key: str(value) for key, value in params.items()}
        note = ""
        if ids.get("run_id") and without_credentials(ids.get("tracking_uri", "")) != without_credentials(uri):
            note = f"; the checkpoint's run {ids['run_id']} is on {mask_text(ids.get('tracking_uri', ''))}: new run"
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
        return ({"run_id": self.run_id, "tracking_uri": shown},
                f"mlflow run {self.run_id} ({'resumed, ' if resumed else ''}{shown}){note}")

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


def use_credentials(uri: str) -> str:
    """The URI to give MlflowClient: a password in ``uri`` moves to this process's environment
    (MLFLOW_TRACKING_USERNAME/PASSWORD, which MLflow reads at every request), so that no URI that
    MLflow might print or store holds it. A password masked by hvdtrain (``***``, e.g. from a
    checkpoint's or config.yaml's copy) is never sent: the environment must then hold the real one."""
    bare, user, password = split_credentials(uri)
    if password is None:
        return uri
    if password == MASK:
        if not os.environ.get("MLFLOW_TRACKING_PASSWORD"):
            raise ValueError(f"tracking.mlflow.tracking_uri {uri} holds a masked password (a copy from config.yaml "
                             f"or a checkpoint): set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, and "
                             f"give the URI without them ({bare})")
    else:
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password
    if user:
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
    return bare


BACKENDS: dict[str, Callable[[Config, Path], Backend]] = {"wandb": WandbBackend, "mlflow": MlflowBackend}


def first_line(error: BaseException) -> str:
    text = mask_text(str(error)).strip().splitlines()
    return (f"{type(error).__name__}: {text[0]}" if text else type(error).__name__)[:200]


# --- the sender --------------------------------------------------------------------------------

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
    """The sender process (``python -c "from hvdtrain.observe.tracking_sender import serve; ..."``)."""
    # The job's stop signals (a scheduler signals every process of the job) are the training
    # process's to handle: it asks this process to end the runs with the right status.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, signal.SIG_IGN)
    inbox, outbox = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    cfg, run_dir, names, ids, params, env = inbox.recv()
    Sender(cfg, run_dir, names, inbox, outbox).run(ids, params, env, os.getppid(), time.process_time)


def helper_cpu() -> str:
    """The CPU time so far of the trackers' helper processes (W&B's ``wandb-core``), which run beside
    the training process on its machine."""
    try:
        seconds = sum(sum(child.cpu_times()[:2]) for child in psutil.Process().children(recursive=True)
                      if "wandb" in child.name())
    except psutil.Error:  # gone meanwhile: nothing to report
        return ""
    return f"; wandb-core {seconds:.2f} s CPU so far" if seconds else ""
