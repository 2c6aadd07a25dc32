"""What a 2-rank test job costs the suite: launched for real, and on the suite's shared launched ranks
(tests/shared_ranks), side by side in one run; and what a rank's imports cost.

    python benchmarks/launch_cost.py [--repeats 3] [--kinds horovodrun-gloo mpirun]

Each job is the debug config (2 epochs of 4 steps, ResNet-18 at 32 px) on the suite's tiny image
folder (4 classes, 96 training and 20 validation images), the job a typical launched test runs.
The first job on the shared ranks also pays their launch, so it is printed apart from the rest.
Imports are timed in fresh interpreters, as a rank starts.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests import shared_ranks  # noqa: E402
from tests.helpers import job_env, launch_command  # noqa: E402

IMPORTS = {
    "torch": "import torch",
    "torchvision": "import torchvision",
    "hvdtrain's training loop": "import hvdtrain.train.run",
    "a rank's start (loop, task, model)": "import hvdtrain.train.run, hvdtrain.tasks, horovod.torch",
}


def tiny_data(root: Path) -> Path:
    from hvdtrain.data.demo import generate

    generate(root, train_per_class=24, val_per_class=5, size=40, num_classes=4)  # as tests/conftest.py's
    return root


def debug_job(data: Path, folder: Path) -> list[str]:
    return ["-m", "hvdtrain", "--config", "debug", f"data.dir={data}", f"output.dir={folder / 'run'}"]


def time_job(kind: str, data: Path, folder: Path, shared: bool) -> tuple[float, int]:
    folder.mkdir(parents=True)
    program = debug_job(data, folder)
    env = job_env(folder)
    started = time.perf_counter()
    if shared:
        result = shared_ranks.run(kind, 2, program, folder, env, timeout=600)
        assert result is not None, "the shared ranks refused the debug job"
    else:
        result = subprocess.run(launch_command(kind, 2, program), cwd=folder, env=env, capture_output=True,
                                text=True, timeout=600)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{kind} job failed ({result.returncode}):\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return seconds, result.stdout.count("epoch 2/2")


def import_seconds(statement: str, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
        times.append(float(out.stdout.strip()))
    return times


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} s (min {min(values):.2f}, max {max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kinds", nargs="+", default=["horovodrun-gloo", "mpirun"])
    args = parser.parse_args()

    print(f"imports in a fresh interpreter, {args.repeats} times each (median, min, max):")
    for name, statement in IMPORTS.items():
        print(f"  {name:36s} {spread(import_seconds(statement, args.repeats))}", flush=True)

    with tempfile.TemporaryDirectory(prefix="launch-cost-") as tmp:
        root = Path(tmp)
        data = tiny_data(root / "data")
        for kind in args.kinds:
            fresh = [time_job(kind, data, root / f"{kind}-fresh-{i}", shared=False) for i in range(args.repeats)]
            first = time_job(kind, data, root / f"{kind}-shared-first", shared=True)
            rest = [time_job(kind, data, root / f"{kind}-shared-{i}", shared=True) for i in range(args.repeats)]
            epochs = sum(done for _, done in fresh + [first] + rest)
            print(f"{kind}: 2-rank debug job, {len(fresh) + 1 + len(rest)} jobs, {epochs} final epochs logged")
            print(f"  launched for real            {spread([s for s, _ in fresh])}")
            print(f"  shared ranks, first job      {first[0]:6.2f} s (includes their launch)")
            print(f"  shared ranks, later jobs     {spread([s for s, _ in rest])}")
    for line in shared_ranks.stop_all():
        print(line)


if __name__ == "__main__":
    main()
