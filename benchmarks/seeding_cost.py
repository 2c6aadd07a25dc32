"""What per-sample seeding costs: microseconds per sample of an in-memory 8x8 dataset, loaded
through each wrapper, in the training process and in a DataLoader worker.

    python benchmarks/seeding_cost.py --samples 1437 --repeats 5

Wrappers: ``plain`` (``dataset[index]``), ``IndexedSamples`` (the short path's default: the
sampler's (index, seed) pair, no seeding), ``SeededSamples`` (seeds torch's CPU generator and
Python's per sample; restores the caller's streams in the training process only) and ``before``
(SeededSamples as it was: ``torch.random.fork_rng`` + ``torch.manual_seed``, which also seeds every
CUDA device, + Python's state saved and restored, every sample). Medians over ``--repeats``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hvdtrain.data.sampler import IndexedSamples, SeededSamples, sample_seeds  # noqa: E402


class Plain(Dataset):
    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, key):
        return self.dataset[key[0]]


class Before(Dataset):
    """SeededSamples as it was with torch.manual_seed inside fork_rng (about 1 ms a sample)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __getitem__(self, key):
        python_state = random.getstate()
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(key[1])
            random.seed(key[1])
            try:
                return self.dataset[key[0]]
            finally:
                random.setstate(python_state)


WRAPPERS = {"plain": Plain, "IndexedSamples": IndexedSamples, "SeededSamples": SeededSamples, "before": Before}


def time_per_sample(wrapped: Dataset, keys: list[tuple[int, int]]) -> float:
    start = time.perf_counter()
    for key in keys:
        wrapped[key]
    return (time.perf_counter() - start) / len(keys) * 1e6


class InWorker(Dataset):
    """Item 0 times the wrapper inside the loader worker that loads it (where get_worker_info() is set)."""

    def __init__(self, wrapped: Dataset, keys: list[tuple[int, int]]):
        self.wrapped, self.keys = wrapped, keys

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> float:
        return time_per_sample(self.wrapped, self.keys)


def measure(samples: int, repeats: int) -> dict[str, dict[str, float]]:
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.rand(samples, 1, 8, 8, generator=generator), torch.randint(0, 10, (samples,)))
    keys = list(zip(range(samples), sample_seeds(0, 0, np.arange(samples)).tolist()))
    results: dict[str, dict[str, float]] = {}
    for name, wrapper in WRAPPERS.items():
        wrapped = wrapper(dataset)
        time_per_sample(wrapped, keys[:100])  # warm-up
        main = statistics.median(time_per_sample(wrapped, keys) for _ in range(repeats))
        loader = DataLoader(InWorker(wrapped, keys), batch_size=None, num_workers=1, multiprocessing_context="fork")
        worker = statistics.median(next(iter(loader)) for _ in range(repeats))
        results[name] = {"training_process_us": main, "worker_us": worker, "samples": len(keys) * repeats}
    return results


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1437)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    results = measure(args.samples, args.repeats)
    print(f"{'wrapper':<16} {'training process':>18} {'loader worker':>15}   (us per sample, median of {args.repeats})")
    for name, row in results.items():
        print(f"{name:<16} {row['training_process_us']:>18.1f} {row['worker_us']:>15.1f}")
    return results


if __name__ == "__main__":
    torch.set_num_threads(1)  # the per-sample work, not the thread pool
    main()
