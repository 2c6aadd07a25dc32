"""Every piece of process-wide state a job can change that the shared ranks put back after it, in one
place: the next job must find what a fresh process would. The server restores, besides this list,
the environment, working folder, argv, sys.path, streams, signal handlers, atexit calls, the modules
a job imported from outside the installed packages, CPU affinity, warnings filters, the forkserver
and the heap (tests/shared_ranks/server.py, Job.run).

tests/parallel/test_shared_ranks.py changes each entry in a job and checks that the next job finds
what a fresh process finds, so an entry that stops being restored fails there.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import multiprocessing
import os
import random
import socket
import sys
import threading
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing


def _umask() -> int:
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def _set_start_method(method: str | None) -> None:
    multiprocessing.set_start_method(method, force=True)


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _set_cudnn_benchmark(value: bool) -> None:
    torch.backends.cudnn.benchmark = value


def _root_logger() -> tuple[int, tuple]:
    return logging.root.level, tuple(logging.root.handlers)


def _set_root_logger(value: tuple[int, tuple]) -> None:
    logging.root.setLevel(value[0])
    logging.root.handlers[:] = list(value[1])


def _hooks() -> tuple:
    return sys.excepthook, threading.excepthook, sys.unraisablehook


def _set_hooks(value: tuple) -> None:
    sys.excepthook, threading.excepthook, sys.unraisablehook = value


def _gc() -> tuple[bool, tuple]:
    return gc.isenabled(), gc.get_threshold()


def _set_gc(value: tuple[bool, tuple]) -> None:
    gc.enable() if value[0] else gc.disable()
    gc.set_threshold(*value[1])


def _set_faulthandler(enabled: bool) -> None:
    faulthandler.enable() if enabled else faulthandler.disable()


# name -> (read, write back). Each read gives a value that compares equal when nothing changed.
STATE: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
    "torch threads": (torch.get_num_threads, torch.set_num_threads),
    "torch default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "torch deterministic algorithms": (
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        _set_deterministic),
    "cuDNN benchmark": (lambda: torch.backends.cudnn.benchmark, _set_cudnn_benchmark),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "torch grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "torch anomaly detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "torch CPU generator": (torch.get_rng_state, torch.set_rng_state),
    "Python's random": (random.getstate, random.setstate),
    "NumPy's global generator": (np.random.get_state, np.random.set_state),
    "umask": (_umask, os.umask),
    "recursion limit": (sys.getrecursionlimit, sys.setrecursionlimit),
    "socket default timeout": (socket.getdefaulttimeout, socket.setdefaulttimeout),
    "multiprocessing start method": (lambda: multiprocessing.get_start_method(allow_none=True), _set_start_method),
    "torch sharing strategy": (torch.multiprocessing.get_sharing_strategy,
                               torch.multiprocessing.set_sharing_strategy),
    "root logger": (_root_logger, _set_root_logger),
    "exception hooks": (_hooks, _set_hooks),
    "garbage collector": (_gc, _set_gc),
    "faulthandler": (faulthandler.is_enabled, _set_faulthandler),
}
# A fresh process seeds these from the OS (torch too, since 2.x: torch.initial_seed() differs from
# process to process): restored, but not comparable with another process's.
SEEDED_FROM_THE_OS = {"torch CPU generator", "Python's random", "NumPy's global generator"}


def snapshot() -> dict[str, Any]:
    return {name: read() for name, (read, _) in STATE.items()}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        return all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return np.array_equal(a, b)
    return a == b


def restore(saved: dict[str, Any]) -> list[str]:
    """Put back every entry that differs from ``saved``; the names of those put back."""
    changed = []
    for name, (read, write) in STATE.items():
        if not _same(read(), saved[name]):
            write(saved[name])
            changed.append(name)
    return changed


def describe() -> dict[str, str]:
    """Each comparable entry as text, as a fresh process and the shared ranks can both write it."""
    found = {}
    for name, (read, _) in STATE.items():
        if name in SEEDED_FROM_THE_OS:
            continue
        value = read()
        if name == "root logger":
            value = (value[0], [type(handler).__name__ for handler in value[1]])
        elif name == "exception hooks":
            value = [getattr(hook, "__qualname__", repr(hook)) for hook in value]
        found[name] = repr(value)
    return found
