"""The sampler's part of ``benchmarks/data_scale.py``: an epoch's start and memory for ``ShardedSampler``.

``child_sampler`` runs in a fresh process (``data_scale.py --child sampler``): rank 1 of ``--ranks``
over ``--files`` samples, two epochs. The first epoch's share is drawn when it starts; the next one's
is drawn ahead, on a thread, during the first. Measured: each epoch's start (set_epoch, iter(), the
first sample), the resident memory each start added, the peak over each epoch above the process
before the sampler (the draw ahead included), the samples drawn, and the share's draw alone.
``--sampler-file`` puts another version of ``hvdtrain/data/sampler.py`` in the module's place, to
compare (``data_scale.py --sampler-only --sampler-before FILE`` alternates the two).

``child_first_epoch`` (``data_scale.py --child first-epoch``) measures what the first epoch's draw
costs a run as training starts one: ``set_epoch`` (the draw starts on its thread), then ``iter()``
of a DataLoader with ``--workers`` forkserver workers (their first start, as in training) and its
first batch. ``--drawn-before`` is the control: the share is drawn, and waited for, before the
clock starts. The dataset is ``--files`` bare indices (no file list, no decoding), so the two
differ by the wait for the draw alone (``data_scale.py --first-epoch`` alternates them).
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


class BareIndices:
    """A map-style dataset of ``n`` items, each its own index: the loader's work without a file list."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def child_first_epoch(args: argparse.Namespace) -> dict:
    """set_epoch, iter() and the first batch of a training loader over ``args.files`` bare indices
    with ``args.workers`` workers (see the module's docstring); the share drawn before the clock
    starts under ``args.drawn_before``."""
    import torch
    from torch.utils.data import DataLoader

    from hvdtrain.config import DataConfig
    from hvdtrain.data.loaders import loader_kwargs, shutdown_workers
    from hvdtrain.data.sampler import IndexedSamples, ShardedSampler

    sampler = ShardedSampler(args.files, args.ranks, 1, seed=0)
    loader = DataLoader(IndexedSamples(BareIndices(args.files)), batch_size=args.batch, sampler=sampler,
                        drop_last=True, generator=torch.Generator().manual_seed(0),
                        **loader_kwargs(DataConfig(workers=args.workers), pin_memory=False))
    draw_s = None
    if args.drawn_before:
        start = time.perf_counter()
        sampler.set_epoch(0)
        sampler.index_array()
        draw_s = time.perf_counter() - start
    start = time.perf_counter()
    sampler.set_epoch(0)  # as the trainer does before each epoch (a no-op for a share drawn already)
    batches = iter(loader)
    first = next(batches)
    first_s = time.perf_counter() - start
    expected = torch.as_tensor(sampler.index_array()[:args.batch])
    assert torch.equal(first, expected), "the first batch is not the share's first indices"
    samples = len(first) + sum(len(batch) for _, batch in zip(range(args.batches - 1), batches))
    shutdown_workers(loader)
    return {"first_batch_s": first_s, "draw_s": draw_s, "samples": samples, "share": len(sampler),
            "workers": args.workers}


def measure_first_epoch(n: int, args: argparse.Namespace, run_child: Callable[..., dict]) -> list[dict]:
    """--first-epoch: for each worker count, the first batch with the share drawn at set_epoch (as
    training draws it) and with the share drawn before (the control), alternated ``args.runs``
    times; the difference of each pair is the wait for the draw."""
    rows = []
    for workers in args.workers:
        runs: dict[str, list[dict]] = {"at set_epoch": [], "before": []}
        for run in range(args.runs):
            order = ["at set_epoch", "before"] if run % 2 == 0 else ["before", "at set_epoch"]
            for case in order:
                extra = ["--ranks", str(args.ranks), "--files", str(n), "--workers", str(workers), "--batch",
                         str(args.batch), "--batches", str(args.batches)]
                extra += ["--drawn-before"] if case == "before" else []
                runs[case].append(run_child("first-epoch", args, extra))
        ahead, control = runs["at set_epoch"], runs["before"]
        rows.append({"n": n, "workers": workers, "synthetic": False, "files": n,
                     "first_batch_ahead_s": [r["first_batch_s"] for r in ahead],
                     "first_batch_drawn_s": [r["first_batch_s"] for r in control],
                     "draw_wait_s": [a["first_batch_s"] - c["first_batch_s"] for a, c in zip(ahead, control)],
                     "sampler_draw_s": [r["draw_s"] for r in control],
                     "samples": ahead[-1]["samples"], "share": ahead[-1]["share"]})
    return rows


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
