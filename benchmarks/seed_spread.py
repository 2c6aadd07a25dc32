"""How far a recipe's final accuracy moves with the seed and the machine: the recipe run over
several seeds and several thread counts per rank, 2 ranks under ``horovodrun --gloo``.

A different thread count changes the order of floating-point reductions inside each kernel, as a
different CPU does (AVX2 against AVX-512, another core count), so the spread over thread counts
stands in for the spread over the machines users run the recipe on. ``--isa`` adds oneDNN's
instruction-set caps as a third axis (``avx2`` runs AVX-512 hardware with AVX2 kernels).

    python benchmarks/seed_spread.py                         # make demo's recipe: seeds 0,1,2 x threads 1,2
    python benchmarks/seed_spread.py --config small_images   # scikit-learn's digits (needs the test extra)
    python benchmarks/seed_spread.py --seeds 0,1,2,3 --threads 1,2 --isa default,avx2 -- optim.base_lr=0.2
    python benchmarks/seed_spread.py --seeds 0 --threads 1 --min 30 -- train.epochs=2  # the warm-up alone (tests)

A shorter run (``-- train.epochs=2``) trains the same first epochs: the warm-up is a function of
the epoch alone and the cosine starts after it, so the epochs it runs are the full run's, bit for bit;
only the final value, and so ``--min``, is the full run's alone.

Prints one line per run (the final and the best validation metric, the highest validation loss
of any epoch, the wall time) and then
the minimum, median and maximum of the final values, with a verdict against ``--min`` (every
run at least this) and ``--max-spread`` (max - min at most this), and the runs as JSON last.
Exit code 1 when a target is missed or a run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# oneDNN's names for its instruction-set caps (ONEDNN_MAX_CPU_ISA); "default" leaves the variable unset.
ISA_CAPS = {"default": None, "avx2": "AVX2", "avx512": "AVX512_CORE", "sse41": "SSE41"}


def parse_list(text: str, kind=int) -> list:
    return [kind(part) for part in text.split(",") if part.strip()]


def dataset_overrides(config: str, work: Path) -> list[str]:
    """small_images needs a folder: scikit-learn's digits, written once under ``work``."""
    if config != "small_images":
        return []
    from hvdtrain.data.digits import write_digits

    return [f"data.dir={write_digits(work / 'digits32', size=32, seed=0)}"]


def run_once(args: argparse.Namespace, seed: int, threads: int, isa: str, out: Path, extra: list[str]) -> dict:
    """One training run; its validation records from metrics.jsonl."""
    python = Path(sys.executable)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    if ISA_CAPS[isa]:
        env["ONEDNN_MAX_CPU_ISA"] = ISA_CAPS[isa]
    # With more threads than the rank's share of cores, binding each rank to its share would time-slice
    # the threads on one core: leave placement to the OS then (the numbers do not depend on it).
    affinity = "auto" if threads * args.ranks <= (os.cpu_count() or 1) else "none"
    if affinity == "none":
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning threads on shared cores cost minutes, not bits
    cmd = [str(python.parent / "horovodrun"), "-np", str(args.ranks), "-H", f"localhost:{args.ranks}", "--gloo",
           str(python), "-m", "hvdtrain", "--config", args.config, f"seed={seed}", f"runtime.threads={threads}",
           f"runtime.cpu_affinity={affinity}", f"output.dir={out}", "checkpoint.resume=never",
           "output.progress=false", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        tail = "\n".join(done.stdout.splitlines()[-15:])
        return {"seed": seed, "threads": threads, "isa": isa, "failed": done.returncode, "log": tail}
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in records if r["split"] == "val"]
    metric = args.metric
    return {"seed": seed, "threads": threads, "isa": isa, "epochs": len(val),
            "steps": val[-1]["step"], "samples": sum(r["samples"] for r in records if r["split"] == "train"),
            "final": val[-1][metric], "best": max(r[metric] for r in val),
            "first_val_loss": val[0]["loss"], "val_losses": [r["loss"] for r in val], "seconds": round(seconds, 1)}


def summary(runs: list[dict], args: argparse.Namespace) -> tuple[str, bool]:
    finals = [r["final"] for r in runs if "final" in r]
    failed = [r for r in runs if "failed" in r]
    if not finals:
        return "no run finished", False
    low, mid, high = min(finals), statistics.median(finals), max(finals)
    ok = not failed and low >= args.min and high - low <= args.max_spread
    line = (f"{args.config}: final val {args.metric} over {len(finals)} runs: min {low:.2f}, median {mid:.2f}, "
            f"max {high:.2f}, spread {high - low:.2f} (targets: every run >= {args.min:g}, spread <= "
            f"{args.max_spread:g}: {'met' if ok else 'NOT met'})"
            + (f"; {len(failed)} run(s) failed" if failed else ""))
    return line, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     epilog="Arguments after -- are config overrides passed to every run.")
    parser.add_argument("--config", default="demo", help="a shipped config name or a YAML path (default: demo)")
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default: 0,1,2)")
    parser.add_argument("--threads", default="1,2", help="comma-separated torch threads per rank (default: 1,2)")
    parser.add_argument("--isa", default="default", help=f"comma-separated oneDNN caps: {', '.join(ISA_CAPS)}")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--metric", default="top1", help="the validation metric to compare (default: top1)")
    parser.add_argument("--min", type=float, default=90.0, help="target: every run's final value at least this")
    parser.add_argument("--max-spread", type=float, default=5.0, help="target: max - min at most this")
    parser.add_argument("--work", default="", help="folder for data and runs (default: a temporary one)")
    parser.add_argument("overrides", nargs="*", help="config overrides (after --)")
    args = parser.parse_args()
    unknown = [isa for isa in parse_list(args.isa, str) if isa not in ISA_CAPS]
    if unknown:
        parser.error(f"--isa: unknown {', '.join(unknown)} (one of {', '.join(ISA_CAPS)})")
    work = Path(args.work or tempfile.mkdtemp(prefix="hvdtrain-seed-spread-"))
    extra = dataset_overrides(args.config, work) + list(args.overrides)
    runs = []
    start = time.perf_counter()
    for isa in parse_list(args.isa, str):
        for threads in parse_list(args.threads):
            for seed in parse_list(args.seeds):
                out = work / f"{Path(args.config).stem}-seed{seed}-threads{threads}-{isa}"
                result = run_once(args, seed, threads, isa, out, extra)
                runs.append(result)
                if "failed" in result:
                    print(f"seed {seed} threads {threads} isa {isa}: FAILED (exit {result['failed']})\n{result['log']}",
                          flush=True)
                else:
                    print(f"seed {seed} threads {threads} isa {isa}: final {args.metric} {result['final']:.2f}, "
                          f"best {result['best']:.2f}, epoch-1 val loss {result['first_val_loss']:.3g}, "
                          f"highest val loss {max(result['val_losses']):.3g}, "
                          f"{result['epochs']} epochs / {result['steps']} steps / {result['samples']} train samples, "
                          f"{result['seconds']:.0f} s", flush=True)
    line, ok = summary(runs, args)
    print(line)
    print(f"{len(runs)} runs in {time.perf_counter() - start:.0f} s")
    print(json.dumps({"config": args.config, "overrides": extra, "runs": runs}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
