"""The sampler's part of ``benchmarks/data_scale.py``: an epoch's start and memory for ``ShardedSampler``.

``child_sampler`` runs in a fresh process (``data_scale.py --child sampler``): rank 1 of ``--ranks``
over ``--files`` samples, two epochs. The first epoch's share is drawn when it starts; the next one's
is drawn ahead, on a thread, during the first. Measured: each epoch's start (set_epoch, iter(), the
first sample), the resident memory each start added, the peak over each epoch above the process
before the sampler (the draw ahead included), the samples drawn, and the share's draw alone.
``--sampler-file`` puts another version of ``hvdtrain/data/sampler.py`` in the module's place, to
compare (``data_scale.py --sampler-only --sampler-before FILE`` alternates the two).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import threading
import time
from typing import Callable


def child_sampler(args: argparse.Namespace) -> dict:
    """Two epochs of rank 1 of ``args.ranks`` over ``args.files`` samples (see the module's docstring)."""
    import hvdtrain.data

    if args.sampler_file:  # another version of the sampler module (--sampler-before), in its place
        spec = importlib.util.spec_from_file_location("hvdtrain.data.sampler", args.sampler_file)
        hvdtrain.data.sampler = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(hvdtrain.data.sampler)
    from hvdtrain.data import sampler as sampler_module
    from hvdtrain.data.sampler import ShardedSampler

    def status(field: str) -> int:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))

    def draws_running() -> bool:  # the next epoch's share on its thread (absent before that existed)
        return any(t.name.startswith("hvdtrain-sampler") for t in threading.enumerate())

    before = status("VmRSS")
    sampler = ShardedSampler(args.files, args.ranks, 1, seed=0)
    starts, added, peaks, waited = [], [], [], 0.0
    for epoch in (1, 2):
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")  # resets the peak resident size (VmHWM) to the current one
        resident = status("VmRSS")
        start = time.perf_counter()
        sampler.set_epoch(epoch)
        samples = iter(sampler)
        first = next(samples)
        starts.append(time.perf_counter() - start)
        added.append(max(0, status("VmHWM") - resident))  # (the peak is updated lazily: a few KB below at times)
        drawn = 1 + sum(1 for _ in samples)
        assert drawn == len(sampler) and len(first) == 2, (drawn, len(sampler))
        del samples
        # A real epoch (hours at 14.2M samples) outlasts the next epoch's draw; this loop of bare
        # indices may not: wait for the draw, so that the next start is the one training sees.
        start = time.perf_counter()
        while draws_running():
            time.sleep(0.001)
        waited += time.perf_counter() - start
        peaks.append(status("VmHWM") - before)  # the sampler's peak over the epoch, the draw ahead included
    draw_s = []  # after the epochs, not to disturb their memory figures
    if hasattr(sampler_module, "rank_share"):  # the share drawn alone, in this thread: the floor
        for epoch in (7, 8):
            start = time.perf_counter()
            key = sampler_module.ShareKey(args.files, args.ranks, 1, 0, True, True, epoch, 0)
            assert len(sampler_module.rank_share(key)) == drawn  # (freed at once)
            draw_s.append(time.perf_counter() - start)
    return {"start_s": starts, "added": added, "peak": peaks, "draw_s": draw_s, "waited_s": waited, "drawn": drawn}


def sampler_fields(samplers: list[dict]) -> dict:
    """The sampler's first epoch (its share drawn in the caller) apart from the next (drawn ahead)."""
    return {"sampler_first_start_s": [r["start_s"][0] for r in samplers],
            "sampler_next_start_s": [r["start_s"][1] for r in samplers],
            "sampler_peak": [p for r in samplers for p in r.get("peak", [])],
            "sampler_draw_s": [d for r in samplers for d in r.get("draw_s", [])]}


def measure_sampler(n: int, args: argparse.Namespace, run_child: Callable[..., dict]) -> list[dict]:
    """--sampler-only: the sampler's rows, without a folder or an index; with --sampler-before, that
    version's runs alternate with this one's."""
    versions = {"before": args.sampler_before, "after": ""} if args.sampler_before else {None: ""}
    runs: dict = {version: [] for version in versions}
    for _ in range(args.runs):
        for version, path in versions.items():
            extra = ["--ranks", str(args.ranks), "--files", str(n)] + (["--sampler-file", path] if path else [])
            runs[version].append(run_child("sampler", args, extra))
    return [{"n": n, "workers": None, "synthetic": False, "files": n, "version": version,
             "sampler_start_s": [s for r in samplers for s in r["start_s"]],
             "sampler_added": [a for r in samplers for a in r["added"]], "sampler_drawn": samplers[-1]["drawn"],
             **sampler_fields(samplers)} for version, samplers in runs.items()]
