"""How the file list's memory and start-up grow with the dataset, the loader workers and the ranks.

For each dataset size N it builds an ImageFolder of N training files (hard links to one tiny JPEG,
on a tmpfs: /dev/shm by default) with 1,000 classes and ImageNet's proportion of validation files,
or, above ``--folder-max``, a synthetic index (up to 21,841 classes, as ImageNet-21k) written straight
into the index cache over empty class folders: there the files do not exist, so the loader's
samples all come out as bad files (counted as drawn; what is measured is the file list, not JPEG
decoding). Then, each in a fresh process:

* index: rank 0's scan (no cache), the cache's size, the cached load (twice: the range);
* broadcast: ``shared_index`` on 2 ranks (``horovodrun --gloo``), once with rank 1 able to map
  the same cache file (one host) and once without a cache of its own (another host): the seconds
  beyond rank 0's own load;
* loader, for each worker count: ``iter()`` of a training DataLoader (forkserver workers, as
  training starts them) and its first batch, then ``--batches`` batches; PSS (/proc/<pid>/smaps_rollup)
  of the process and all its descendants (fork server, workers), sampled every 0.1 s: the peak sum;
  after the batches, "own" PSS: anonymous and shared memory plus the index cache file's pages (the
  PSS of library pages moves with the other jobs on the machine that map torch too); "list" PSS:
  the file list's pages mapped by any of the processes (one copy at most: its size); per worker,
  what the workers added to own PSS but the list over 0 workers, divided by their number (the fork
  server included); marginal, the same for each worker beyond the next smaller count (the fork
  server left out); and each worker's private memory (which counts list pages only it mapped);
* sampler: ``ShardedSampler`` of ``--ranks`` ranks, rank 1: the epoch start (set_epoch, iter(),
  the first sample) of the first epoch (its share drawn then) and of the next (drawn ahead on a
  thread during the first, waited for if the loop over bare indices ended sooner), the resident
  memory each start added, the peak over each epoch above the process before the sampler (the
  draw ahead included), the whole epoch's samples counted, and the share's draw alone ("draw s").

    python benchmarks/data_scale.py                                   # 10k, 128k, 1.28M, 14.2M; workers 0,4,8
    python benchmarks/data_scale.py --sizes 1k,10k --workers 0,2 --runs 1 --no-broadcast
    python benchmarks/data_scale.py --sizes 1.28M --keep /dev/shm/scale   # keeps the folder for the next run
    python benchmarks/data_scale.py --sizes 1.28M,14.2M --sampler-only --runs 3   # the sampler rows alone
    git show HEAD~1:hvdtrain/data/sampler.py > /tmp/sampler_before.py             # ... against an older sampler,
    python benchmarks/data_scale.py --sizes 14.2M --sampler-only --sampler-before /tmp/sampler_before.py  # alternated
    # the first epoch's draw in training
    python benchmarks/data_scale.py --sizes 1.28M,14.2M --first-epoch --workers 4,8 --runs 4

Prints a table and, per row, ``data_scale: {json}``; ``--json FILE`` writes all rows. Timings are
given as min-max over ``--runs`` runs. Needs free memory for the folder's inodes (about 1 GB at
1.28M files on tmpfs) and, at 14.2M, a few GB for the synthetic list while it is written.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from proc_memory import PssPeak, descendants, memory  # noqa: E402  (benchmarks/, beside this script)
from sampler_epoch import child_first_epoch, child_sampler, measure_first_epoch, measure_sampler, sampler_fields  # noqa: E402  (the same)

BIN = Path(sys.executable).parent
MIB = 1 << 20


def parse_count(text: str) -> int:
    """10k, 1.28M, 14.2M, 1281167 -> an integer (1.28M is ImageNet's 1,281,167; 14.2M is 14,197,122)."""
    named = {"1.28M": 1_281_167, "14.2M": 14_197_122}
    if text in named:
        return named[text]
    scale = {"k": 1_000, "M": 1_000_000}.get(text[-1], 1)
    return int(round(float(text.rstrip("kM")) * scale))


def layout(n: int, synthetic: bool) -> tuple[int, int]:
    """(classes, validation files) for N training files."""
    classes = min(21_841, max(2, n // 100)) if synthetic else min(1000, max(2, n // 10))
    return classes, max(classes, round(n * 50_000 / 1_281_167))


def tiny_jpeg() -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 60, 20)).save(out, format="JPEG")
    return out.getvalue()


def build_folder(root: Path, n: int) -> None:
    """train/ and val/ of hard links to one JPEG (kept when ``root/.complete`` says it holds ``n``)."""
    marker = root / ".complete"
    if marker.is_file() and marker.read_text() == str(n):
        return
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    source = root / "source.jpg"
    source.write_bytes(tiny_jpeg())
    classes, val = layout(n, synthetic=False)
    for split, count in (("train", n), ("val", val)):
        for c in range(classes):
            folder = root / split / f"n{c:08d}"
            folder.mkdir(parents=True)
            for i in range(c, count, classes):
                os.link(source, folder / f"n{c:08d}_{i}.JPEG")
    marker.write_text(str(n))


def synthetic_index(root: Path, cache: Path, n: int) -> float:
    """Empty class folders, and a cache entry for them listing N (missing) files; the seconds the
    cache took to write (what a scan adds to the walk of the folders)."""
    from hvdtrain.data.files.index import FileIndex, SplitIndex, cache_file, cache_key, usable_cache, write_cache

    shutil.rmtree(root, ignore_errors=True)
    classes, val = layout(n, synthetic=True)
    names = [f"n{c:08d}" for c in range(classes)]
    for split in ("train", "val"):
        for name in names:
            (root / split / name).mkdir(parents=True)

    def split(count: int) -> SplitIndex:
        labels = [i * classes // count for i in range(count)]
        return SplitIndex(names, [f"{names[c]}/{names[c]}_{i}.JPEG" for i, c in enumerate(labels)], labels)

    index = FileIndex(str(root), split(n), split(val))
    assert usable_cache(cache) == cache, f"the cache folder {cache} is not the user's own"  # makes file-index/
    start = time.perf_counter()
    written = write_cache(cache_file(root, cache), cache_key(root), index)
    seconds = time.perf_counter() - start
    assert written is not None, f"the synthetic index could not be written to {cache}"
    return seconds


# --- measurements, each in a fresh process --------------------------------------------------------

def index_args(root: str, cache: str | None) -> tuple[Path, Path | None]:
    return Path(root), (Path(cache) if cache else None)


def child_index(args: argparse.Namespace) -> dict:
    from hvdtrain.data.files.index import build_index, cache_file

    root, cache = index_args(args.root, args.cache)
    result: dict = {}
    if not args.no_scan:  # a fresh scan, written to the cache the other measurements read
        shutil.rmtree(cache, ignore_errors=True)
        start = time.perf_counter()
        index = build_index(root, cache)
        result["scan_s"] = time.perf_counter() - start
        assert index.source == "scan", index.source
    loads = []
    for _ in range(2):
        start = time.perf_counter()
        index = build_index(root, cache)
        loads.append(time.perf_counter() - start)
        assert index.source == "cache", index.source
    result.update(load_s=loads, files=len(index.train), val_files=len(index.val),
                  cache_bytes=cache_file(root, cache).stat().st_size)
    return result


def shared(root: Path, cache: Path | None, rank: int):
    """``shared_index`` as training calls it (the facade's collectives)."""
    import inspect

    from hvdtrain.comm import dist
    from hvdtrain.data.files.shared_index import shared_index

    extra = {}
    # allgather is absent from the older JSON-index code this compares against
    if "allgather" in inspect.signature(shared_index).parameters:
        extra["allgather"] = dist.allgather
    return shared_index(root, cache, rank == 0, dist.broadcast_object, **extra)


def child_broadcast(args: argparse.Namespace) -> dict:
    from hvdtrain.comm import dist

    dist.init(gpu=False)
    rank = dist.rank()
    root, cache = index_args(args.root, args.cache)
    result = {}
    for case, own_cache in (("mapped", cache), ("sent", cache if rank == 0 else None)):
        dist.barrier()
        start = time.perf_counter()
        index = shared(root, own_cache, rank)
        seconds = time.perf_counter() - start
        # Beyond rank 0's own load (its index.seconds), the slowest rank: what the broadcast added.
        result[case] = max(dist.allgather_object(seconds - index.seconds))
        assert len(index.train) == args.files, (len(index.train), args.files)
        del index
    return result if rank == 0 else {}


def child_loader(args: argparse.Namespace) -> dict:
    import torch
    from torch.utils.data import DataLoader

    from hvdtrain.config import DataConfig
    from hvdtrain.data.files.shared_index import shared_index
    from hvdtrain.data.image.folder import ImageFiles, collate
    from hvdtrain.data.image.transforms import fast_train_transform
    from hvdtrain.data.loaders import loader_kwargs, shutdown_workers
    from hvdtrain.data.sampler import SeededSamples, ShardedSampler

    root, cache = index_args(args.root, args.cache)
    peak = PssPeak()
    peak.start()
    index = shared_index(root, cache, True)
    data = DataConfig(image_size=16, workers=args.workers)
    files = ImageFiles(root / "train", index.train.paths, index.train.labels, fast_train_transform(data),
                       replace_bad=not args.synthetic)
    sampler = ShardedSampler(len(files), args.ranks, 1, seed=0)
    loader = DataLoader(SeededSamples(files), batch_size=args.batch, sampler=sampler, drop_last=True,
                        collate_fn=collate, generator=torch.Generator().manual_seed(0),
                        **loader_kwargs(data, pin_memory=False))
    peak.sample()
    start = time.perf_counter()
    batches = iter(loader)
    iter_s = time.perf_counter() - start
    samples = bad = 0
    for count in range(min(args.batches, len(loader))):
        images, labels, missing = next(batches)
        samples += len(labels) + len(missing)
        bad += len(missing)
        if count == 0:
            first_s = time.perf_counter() - start
    peak.sample()
    private = [memory(worker.pid)["private"] for worker in getattr(batches, "_workers", [])]
    pids = [os.getpid(), *descendants(os.getpid())]
    detail = [memory(pid, detail=True) for pid in pids]
    own, file_list, processes = sum(d["own"] for d in detail), sum(d["list"] for d in detail), len(pids)
    peak.running = False
    shutdown_workers(loader)
    return {"iter_s": iter_s, "first_batch_s": first_s, "samples": samples, "bad_files": bad,
            "pss_peak": peak.peak, "processes": processes, "own": own, "list": file_list, "files": len(files),
            "worker_private": sum(private) / len(private) if private else 0}


CHILDREN = {"index": child_index, "broadcast": child_broadcast, "loader": child_loader, "sampler": child_sampler,
            "first-epoch": child_first_epoch}


def run_child(kind: str, args: argparse.Namespace, extra: list[str], ranks: int = 1) -> dict:
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", kind, *extra]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if ranks > 1:
        argv = [str(BIN / "horovodrun"), "-np", str(ranks), "-H", f"localhost:{ranks}", "--gloo", *argv]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=args.timeout)
    found = [line.split("child_result: ", 1)[1] for line in done.stdout.splitlines() if "child_result: " in line]
    if done.returncode != 0 or not found:
        sys.exit(f"data_scale: the {kind} measurement failed ({' '.join(argv)}):\n{done.stdout[-3000:]}\n"
                 f"{done.stderr[-3000:]}")
    return max((json.loads(text) for text in found), key=len)


# --- the table -------------------------------------------------------------------------------------

def span(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    low, high = min(values) * scale, max(values) * scale
    return f"{low:.{digits}f}" if f"{low:.{digits}f}" == f"{high:.{digits}f}" else f"{low:.{digits}f}-{high:.{digits}f}"


def measure_size(n: int, args: argparse.Namespace, work: Path) -> list[dict]:
    synthetic = n > args.folder_max
    root = (Path(args.keep) if args.keep else work) / f"n{n}"
    cache = work / f"cache-{n}"
    start, write_s = time.perf_counter(), None
    if synthetic:
        write_s = synthetic_index(root, cache, n)
    else:
        build_folder(root, n)
    built_s = time.perf_counter() - start
    common = (["--root", str(root), "--work", str(work), "--ranks", str(args.ranks)]
              + (["--synthetic"] if synthetic else []))
    index = run_child("index", args, common + ["--cache", str(cache)] + (["--no-scan"] if synthetic else []))
    loads = list(index["load_s"])
    bcast: dict[str, list[float]] = {"mapped": [], "sent": []}
    samplers: list[dict] = []
    loaders: dict[int, list[dict]] = {w: [] for w in args.workers}
    for run in range(args.runs):
        if run:
            loads += run_child("index", args, common + ["--cache", str(cache), "--no-scan"])["load_s"]
        if args.broadcast and n <= args.broadcast_max:
            result = run_child("broadcast", args, common + ["--cache", str(cache), "--files", str(n)], ranks=2)
            for case in bcast:
                bcast[case].append(result[case])
        samplers.append(run_child("sampler", args, common + ["--files", str(n)]))
        if n <= args.loader_max:
            for workers in args.workers:
                loaders[workers].append(run_child("loader", args, common + [
                    "--cache", str(cache), "--workers", str(workers), "--batch", str(args.batch),
                    "--batches", str(args.batches)]))
    rows = []
    for workers in args.workers if n <= args.loader_max else [None]:
        row = {"n": n, "workers": workers, "synthetic": synthetic, "files": index["files"],
               "val_files": index["val_files"], "build_s": built_s, "scan_s": index.get("scan_s"),
               "cache_write_s": write_s,
               "cache_bytes": index["cache_bytes"], "load_s": loads, "broadcast_mapped_s": bcast["mapped"],
               "broadcast_sent_s": bcast["sent"], "sampler_start_s": [s for r in samplers for s in r["start_s"]],
               "sampler_added": [a for r in samplers for a in r["added"]], "sampler_drawn": samplers[-1]["drawn"],
               **sampler_fields(samplers)}
        if workers is not None:
            runs = loaders[workers]
            zero = loaders.get(0)
            row.update(pss_peak=[r["pss_peak"] for r in runs], loader_iter_s=[r["iter_s"] for r in runs],
                       first_batch_s=[r["first_batch_s"] for r in runs], samples=runs[-1]["samples"],
                       bad_files=runs[-1]["bad_files"], processes=runs[-1]["processes"],
                       worker_private=[r["worker_private"] for r in runs])
            row["own"], row["list"] = [r["own"] for r in runs], [r["list"] for r in runs]

            def rest(r: dict) -> int:  # own PSS but the file list's pages (counted once, in "list")
                return r["own"] - r["list"]

            if workers and zero:  # what the workers added, the fork server included, per worker
                row["per_worker"] = [(rest(r) - rest(z)) / workers for r, z in zip(runs, zero)]
            fewer = [w for w in args.workers if 0 < w < (workers or 0)]
            if fewer:  # what one more worker costs, the fork server's share left out
                base = loaders[max(fewer)]
                row["marginal"] = [(rest(r) - rest(b)) / (workers - max(fewer)) for r, b in zip(runs, base)]
        rows.append(row)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    shutil.rmtree(cache, ignore_errors=True)
    return rows


COLUMNS = ["N", "workers", "PSS peak MiB", "own PSS MiB", "list PSS MiB", "per worker MiB", "marginal MiB",
           "worker private MiB", "scan s", "cache MB", "load s", "bcast mapped s", "bcast sent s", "loader iter s",
           "first batch s", "sampler draw s", "sampler first start s", "sampler next start s", "sampler MiB at start",
           "sampler peak MiB"]


def cells(row: dict) -> list[str]:
    def opt(key: str, scale: float = 1.0, digits: int = 2) -> str:
        value = row.get(key)
        if value is None or value == []:
            return "-"
        return span(value if isinstance(value, list) else [value], scale, digits)

    name = (f"{row['n']:,}" + (" (synthetic)" if row["synthetic"] else "")
            + (f" ({row['version']})" if row.get("version") else ""))
    return [name, "-" if row["workers"] is None else str(row["workers"]),
            opt("pss_peak", 1 / MIB, 0), opt("own", 1 / MIB, 0), opt("list", 1 / MIB, 1), opt("per_worker", 1 / MIB, 1),
            opt("marginal", 1 / MIB, 1), opt("worker_private", 1 / MIB, 1),
            opt("scan_s"), opt("cache_bytes", 1e-6, 1), opt("load_s", 1, 3), opt("broadcast_mapped_s"),
            opt("broadcast_sent_s"), opt("loader_iter_s"), opt("first_batch_s"), opt("sampler_draw_s", 1, 3),
            opt("sampler_first_start_s", 1, 3), opt("sampler_next_start_s", 1, 3), opt("sampler_added", 1 / MIB, 0),
            opt("sampler_peak", 1 / MIB, 0)]


FIRST_EPOCH_COLUMNS = ["N (rank 1 of --ranks)", "workers", "first batch s, drawn at set_epoch", "drawn before",
                       "wait for the draw s", "draw alone s", "samples"]


def first_epoch_cells(row: dict) -> list[str]:
    return [f"{row['n']:,}", str(row["workers"]), span(row["first_batch_ahead_s"]), span(row["first_batch_drawn_s"]),
            span(row["draw_wait_s"]), span(row["sampler_draw_s"], 1, 3), f"{row['samples']:,}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10k,128k,1.28M,14.2M")
    parser.add_argument("--workers", default="0,4,8")
    parser.add_argument("--folder-max", default="1.28M", help="larger sizes get a synthetic index, not files")
    parser.add_argument("--loader-max", default="14.2M", help="no loader rows above this size")
    parser.add_argument("--broadcast-max", default="14.2M", help="no broadcast above this size")
    parser.add_argument("--no-broadcast", dest="broadcast", action="store_false", help="skip the 2-rank launches")
    parser.add_argument("--sampler-only", action="store_true", help="only the sampler rows (no folder, no index)")
    parser.add_argument("--sampler-before", default="", help="with --sampler-only: a file holding another version of "
                        "hvdtrain/data/sampler.py (git show REV:hvdtrain/data/sampler.py > FILE), run alternately")
    parser.add_argument("--first-epoch", action="store_true", help="only the first epoch's wait for its draw, "
                        "in a training loader with --workers workers (no folder, no index)")
    parser.add_argument("--ranks", type=int, default=8, help="ranks the sampler's epoch is split over")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=40, help="batches each loader run draws")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--root", default="/dev/shm", help="where the folders are built (a tmpfs)")
    parser.add_argument("--keep", default="", help="build the folders here and keep them for the next run")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", default="")
    parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    parser.add_argument("--work", default="", help=argparse.SUPPRESS)
    parser.add_argument("--synthetic", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-scan", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--files", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--sampler-file", default="", help=argparse.SUPPRESS)
    parser.add_argument("--drawn-before", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sampler_before and not args.sampler_only:
        parser.error("--sampler-before compares samplers alone: add --sampler-only")
    if args.first_epoch and args.sampler_only:
        parser.error("--first-epoch and --sampler-only are two separate measurements: choose one")
    if args.child:
        args.workers = int(args.workers.split(",")[0])
        print("child_result: " + json.dumps(CHILDREN[args.child](args)), flush=True)
        return
    sizes = [parse_count(s) for s in args.sizes.split(",")]
    args.workers = [int(w) for w in args.workers.split(",")]
    args.folder_max, args.loader_max, args.broadcast_max = (
        parse_count(args.folder_max), parse_count(args.loader_max), parse_count(args.broadcast_max))
    work = Path(tempfile.mkdtemp(prefix="hvdtrain-data-scale-", dir=args.root))
    rows = []
    shown = [0, *range(len(COLUMNS) - 5, len(COLUMNS))] if args.sampler_only else range(len(COLUMNS))
    header = FIRST_EPOCH_COLUMNS if args.first_epoch else [COLUMNS[i] for i in shown]

    def measure(n: int) -> list[dict]:
        if args.first_epoch:
            return measure_first_epoch(n, args, run_child)
        return measure_sampler(n, args, run_child) if args.sampler_only else measure_size(n, args, work)

    def show(row: dict) -> list[str]:
        return first_epoch_cells(row) if args.first_epoch else [cells(row)[i] for i in shown]

    try:
        print(" | ".join(header), flush=True)
        for n in sizes:
            for row in measure(n):
                rows.append(row)
                print(" | ".join(show(row)), flush=True)
                print("data_scale: " + json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
