"""glibc's malloc for a rank that trains on the CPU: keep the memory a step frees for the next step.

PyTorch on the CPU takes every step's activations and gradients from malloc and frees them before
the next step. glibc serves a block above its mmap threshold (128 KiB at first, raised as blocks are
freed, to at most 32 MiB) with a fresh ``mmap`` and unmaps it at ``free``, and gives the top of its
heap back to the kernel past its trim threshold. The next step then faults the same pages in again,
and the kernel zeroes each one: resnet18 at 224 px, batch 16, one thread took 72,000-106,000 minor
page faults per step (290-430 MB of pages), a hand-written loop as much as hvdtrain, by a count that
varies from run to run with the order of the frees. With the settings below: 0-5,000, and a step
in 0.72-1.04 of the time (8 alternated pairs, median 0.89;
benchmarks/results/host-malloc_intel-xeon-2core_2026-11-27.md).

``tuned`` (``runtime.host_malloc``; ``auto`` = tuned where the ranks train on the CPU) sets, through
``mallopt``: no block from ``mmap`` (M_MMAP_MAX=0), up to 1 GiB kept free at the heap's top
(M_TRIM_THRESHOLD) and the heap grown 64 MiB at a time (M_TOP_PAD). A rank's peak memory grows by
2-14% (30-190 MB there). Loader workers started by forkserver (``data.mp_context``'s
default) or spawn begin with glibc's defaults; forked ones inherit the tuning. The environment
wins: glibc's own MALLOC_* variables or GLIBC_TUNABLES, or another allocator in LD_PRELOAD
(jemalloc, tcmalloc, mimalloc), leave malloc as they set it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_MAX = -4
TUNED = {M_MMAP_MAX: 0, M_TRIM_THRESHOLD: 1 << 30, M_TOP_PAD: 64 << 20}
NAMES = {M_MMAP_MAX: "M_MMAP_MAX", M_TRIM_THRESHOLD: "M_TRIM_THRESHOLD", M_TOP_PAD: "M_TOP_PAD"}

ENV_SETTINGS = ("MALLOC_MMAP_MAX_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                "MALLOC_ARENA_MAX")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")


def wanted(mode: str, device_type: str) -> bool:
    """Whether ``runtime.host_malloc`` asks for the tuned settings on this device."""
    return mode == "tuned" or (mode == "auto" and device_type == "cpu")


def environment_choice(env: Mapping[str, str]) -> str | None:
    """What in the environment already decides malloc's settings, or None."""
    preload = env.get("LD_PRELOAD", "")
    for name in OTHER_ALLOCATORS:
        if name in preload:
            return f"{name} in LD_PRELOAD"
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    named = [key for key in ENV_SETTINGS if key in env]
    return named[0] if named else None


def glibc_mallopt() -> Callable[[int, int], int] | None:
    """glibc's mallopt, or None where the C library is another (musl, macOS)."""
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt


def apply(mode: str, device_type: str, env: Mapping[str, str] | None = None,
          mallopt: Callable[[int, int], int] | None = None) -> str | None:
    """Set malloc up for this rank per ``runtime.host_malloc``. Returns the start-up line's words for
    what malloc does, None where the settings were not asked for (``system``, or ``auto`` on a GPU)."""
    if not wanted(mode, device_type):
        return None
    env = os.environ if env is None else env
    chosen = environment_choice(env)
    if chosen:
        return f"as {chosen} sets it"
    mallopt = mallopt or glibc_mallopt()
    if mallopt is None:
        return "the C library's defaults (not glibc)"
    refused = [NAMES[param] for param, value in TUNED.items() if mallopt(param, value) != 1]
    if refused:
        return f"{'partly tuned' if len(refused) < len(TUNED) else 'defaults'} (mallopt refused {', '.join(refused)})"
    return "tuned"
