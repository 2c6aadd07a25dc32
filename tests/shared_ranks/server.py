"""One rank of a shared launched job: started once by a real launcher (horovodrun, mpirun, or plain
python for one rank), it imports torch, torchvision and hvdtrain once, initializes Horovod once, and
then runs the test jobs it is sent, one after the other, in this process, as the launcher would
have run them: the same argv (``-m hvdtrain ...`` or a script), working folder and environment,
with its stdout and stderr in files of the job's own, and its exit code.

What a fresh launch would give and this process cannot (Horovod initialized with other settings, a
different environment for Horovod, a different number of ranks) is refused before the job runs
(``OWN_LAUNCH``), and the client launches that job for real. The client (tests/shared_ranks/
__init__.py) talks to each rank over one Unix socket: a JSON line per job each way.

Usage: python -m tests.shared_ranks.server SOCKET  (under the launcher)
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import json
import os
import runpy
import signal
import socket
import sys
import threading
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

from tests.shared_ranks import process_state

PACKAGE = Path(__file__).resolve().parents[2] / "hvdtrain"
# The exit code that asks the client to launch the job for real instead.
OWN_LAUNCH = 254
# Environment variables read once per process (by the launcher, Horovod's start, the dynamic loader,
# glibc's malloc, the interpreter, OpenMP): a job that sets one to another value than this process
# started with needs a launch of its own.
INIT_PREFIXES = ("HOROVOD_", "OMPI_", "GLOO_", "NCCL_", "PMIX_", "LD_", "MALLOC_", "GLIBC_TUNABLES", "PYTHON",
                 "OMP_", "MKL_", "KMP_")
HANDLED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGALRM)


RUNNING = threading.Event()  # a job's own code is running (a cancel may interrupt it)


class NeedsOwnLaunch(BaseException):
    """Raised inside a job that this process cannot run as a fresh launch would."""


class Cancelled(BaseException):
    """The client ended the job: another rank left it first (a launcher would end this rank)."""


def warm_up() -> None:
    """Import what every job imports, and start Horovod with the settings a default run asks for; the
    jobs then find, in place of ``dist.init``, a check that they ask for nothing else."""
    import torch  # noqa: F401
    import torch._dynamo  # noqa: F401  (the optimizer step imports it)
    import torchvision  # noqa: F401

    import hvdtrain.cli  # noqa: F401
    import hvdtrain.train.trainer  # noqa: F401
    from hvdtrain.comm import dist
    from hvdtrain.config import Config

    defaults = Config().dist
    started = {"gpu": False, "elastic": False, "timeline": False,
               "stall": (defaults.stall_warning_seconds,
                         defaults.stall_shutdown_seconds if defaults.stall_warning_seconds > 0 else 0)}
    dist.init(gpu=False, timeout_seconds=defaults.timeout_seconds, elastic=False,
              stall_warning_seconds=defaults.stall_warning_seconds,
              stall_shutdown_seconds=defaults.stall_shutdown_seconds, timeline=False)

    def shared_init(gpu=None, timeout_seconds=0, elastic=False, stall_warning_seconds=None,
                    stall_shutdown_seconds=0, timeline=False, engine="horovod") -> None:
        # Gloo's own collective timeout stays the pool's (45 s, the default run's): the tests whose
        # subject is a timeout launch for real; hvdtrain's watchdog takes each job's own.
        if engine != "horovod":
            raise NeedsOwnLaunch(f"the shared ranks run the Horovod engine, the job asks for dist.engine={engine}")
        asked = {"gpu": bool(gpu), "elastic": elastic, "timeline": bool(timeline),
                 "stall": started["stall"] if stall_warning_seconds is None
                 else (stall_warning_seconds, stall_shutdown_seconds if stall_warning_seconds > 0 else 0)}
        if asked != started:
            raise NeedsOwnLaunch(f"Horovod started with {started}, the job asks for {asked}")

    dist.init = shared_init


def launcher_variables(started_env: dict[str, str], client_env: dict[str, str]) -> dict[str, str]:
    """What the launcher (and Horovod's start) added to this process's environment."""
    return {key: value for key, value in started_env.items() if client_env.get(key) != value}


def init_conflicts(job_env: dict[str, str], started_env: dict[str, str]) -> list[str]:
    return sorted(key for key, value in job_env.items()
                  if key.startswith(INIT_PREFIXES) and started_env.get(key, value) != value)


class Job:
    """One request: run ``argv`` as ``python argv...`` would, in ``cwd`` with ``env``."""

    def __init__(self, request: dict[str, Any], launcher_env: dict[str, str]) -> None:
        self.argv: list[str] = request["argv"]
        self.cwd: str = request["cwd"]
        self.env = {**request["env"], **launcher_env}
        self.stdout, self.stderr = request["stdout"], request["stderr"]

    def run(self) -> int:
        saved_env, saved_cwd, saved_argv, saved_path = dict(os.environ), os.getcwd(), sys.argv, list(sys.path)
        saved_streams, saved_modules = (sys.stdout, sys.stderr), set(sys.modules)
        saved_cores, saved_filters = sorted(os.sched_getaffinity(0)), list(warnings.filters)
        saved_handlers = {sig: signal.getsignal(sig) for sig in HANDLED_SIGNALS if sig != signal.SIGUSR2}
        saved_state = process_state.snapshot()
        exits: list[tuple[Callable, tuple, dict]] = []
        register = atexit.register
        atexit.register = lambda func, *a, **k: (exits.append((func, a, k)), func)[1]
        streams = redirect(self.stdout, self.stderr)
        try:
            os.environ.clear()
            os.environ.update(self.env)
            os.chdir(self.cwd)
            return self.execute()
        finally:
            for func, args, kwargs in reversed(exits):  # what the job's process would run at its exit
                try:
                    func(*args, **kwargs)
                except Exception:
                    traceback.print_exc()
            atexit.register = register
            sys.stdout, sys.stderr = saved_streams
            restore(streams)
            for sig, handler in saved_handlers.items():
                signal.signal(sig, handler)
            os.environ.clear()
            os.environ.update(saved_env)
            os.chdir(saved_cwd)
            sys.argv, sys.path[:] = saved_argv, saved_path
            forget_modules(set(sys.modules) - saved_modules)
            fresh_process_state(saved_cores, saved_filters)
            process_state.restore(saved_state)
            stop_forkserver()
            gc.collect()
            release_heap()

    def execute(self) -> int:
        """The job's exit code, as the interpreter would give it."""
        RUNNING.set()
        try:
            if self.argv[0] == "-m":
                sys.argv = [self.argv[1], *self.argv[2:]]
                sys.path.insert(0, self.cwd)
                runpy.run_module(self.argv[1], run_name="__main__", alter_sys=True)
            elif self.argv[0] == "-c":
                sys.argv = ["-c", *self.argv[2:]]
                sys.path.insert(0, "")
                exec(compile(self.argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                script = str(Path(self.argv[0]).resolve())
                sys.argv = [self.argv[0], *self.argv[1:]]
                sys.path.insert(0, str(Path(script).parent))
                runpy.run_path(script, run_name="__main__")
            return 0
        except SystemExit as leave:
            return exit_code(leave.code)
        except (NeedsOwnLaunch, Cancelled):
            raise
        except BaseException:  # what the interpreter prints for an uncaught exception
            RUNNING.clear()
            traceback.print_exc()
            sys.stderr.flush()
            return 1
        finally:
            RUNNING.clear()


def fresh_process_state(cores: list[int], filters: list) -> None:
    """What a fresh process would start the next job with: every thread back on the cores this one
    started on (a job's runtime.cpu_affinity binds them, and the next job would take that binding
    for its launcher's), and Python's warnings filters as they were with every "once per place"
    record forgotten (else a warning a job gave is never shown, or counted, in the next)."""
    from hvdtrain.launch.placement import bind_threads  # imported by warm_up already

    bind_threads(cores)
    warnings.filters[:] = filters
    warnings._filters_mutated()  # every module's __warningregistry__ is stale from here on


def release_heap() -> None:
    """Give the heap a job freed back to the system: a run's tuned malloc (runtime.host_malloc) keeps
    up to 1 GiB for its next step, and this process outlives the run (each pytest-xdist worker has
    its own shared ranks)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def stop_forkserver() -> None:
    """End the forkserver a job's loader workers were forked from. It started inside the job, so
    its workers had the job's environment (credentials, HVDTRAIN_CACHE), working folder and output,
    as in a fresh launch; the next job's workers must have theirs."""
    from multiprocessing import forkserver

    server = forkserver._forkserver
    if server._forkserver_pid is not None:
        server._stop()


def forget_modules(names: set[str]) -> None:
    """Unload the modules a job imported from outside the installed packages and hvdtrain (its script,
    a task file): a fresh process would import them again, and the next job may bring a file of the
    same name with other contents."""
    keep = (os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix), str(PACKAGE))
    for name in names:
        path = getattr(sys.modules.get(name), "__file__", None)
        if path and not os.path.realpath(path).startswith(keep):
            del sys.modules[name]


def exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr, flush=True)
    return 1


def redirect(stdout: str, stderr: str) -> tuple[int, int]:
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.dup2(target, fd)
        os.close(target)
    return saved


def restore(saved: tuple[int, int]) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
    for fd, copy in zip((1, 2), saved):
        os.dup2(copy, fd)
        os.close(copy)


# Threads a library keeps for the whole process and reuses from one run to the next, not a run's own:
# fsspec's event loop for s3fs (and the executor thread of that loop).
PROCESS_WIDE_THREADS = ("fsspecIO", "asyncio_")


def leftover_threads(before: set[int], grace: float = 5.0) -> list[str]:
    """Threads a job started and left running, after giving them ``grace`` seconds to end."""
    names = []
    for thread in threading.enumerate():
        if thread.name.startswith(PROCESS_WIDE_THREADS):
            before.add(thread.ident)
        elif thread.ident not in before and thread is not threading.current_thread():
            thread.join(grace)
            if thread.is_alive():
                names.append(thread.name)
    return names


def serve(path: str) -> None:
    client_env = json.loads(os.environ.pop("HVDTRAIN_SHARED_CLIENT_ENV"))
    warm_up()
    from hvdtrain.comm import dist

    launcher_env = launcher_variables(dict(os.environ), client_env)
    started_env = dict(os.environ)

    def cancel(signum, frame):
        if RUNNING.is_set():  # not once the job has left: its clean-up runs to the end
            raise Cancelled()

    signal.signal(signal.SIGUSR2, cancel)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(path)
    channel = connection.makefile("rw", encoding="utf-8")
    channel.write(json.dumps({"rank": dist.rank(), "size": dist.size(), "pid": os.getpid()}) + "\n")
    channel.flush()
    baseline = {thread.ident for thread in threading.enumerate()}
    for line in channel:
        request = json.loads(line)
        job = Job(request, launcher_env)
        conflicts = init_conflicts(request["env"], started_env)
        result: dict[str, Any] = {"code": OWN_LAUNCH, "why": f"sets {', '.join(conflicts)}"} if conflicts else {}
        if not conflicts:
            try:
                result = {"code": job.run()}
            except NeedsOwnLaunch as why:
                result = {"code": OWN_LAUNCH, "why": str(why)}
            except Cancelled:
                result = {"code": None, "cancelled": True}
            result["threads"] = leftover_threads(baseline)
        channel.write(json.dumps(result) + "\n")
        channel.flush()


if __name__ == "__main__":
    serve(sys.argv[1])
