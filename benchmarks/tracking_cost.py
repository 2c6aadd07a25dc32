"""What experiment tracking costs a training step: CPU resnet18, one rank, synthetic data, with
tracking off and with both trackers on (W&B offline, MLflow against a running server) sending
step-level values at every step (the worst case; the default is every 10 steps).

    python benchmarks/tracking_cost.py --mlflow-uri http://127.0.0.1:5000 [--rounds 3] [--steps 20]

Each round runs "off" and "on" once, alternating which goes first. A run's step time is its second
epoch's training seconds over its steps (the first epoch holds start-up: the trackers' imports and
run creation happen on their background thread then). Prints per round and the medians: step time
off and on, their ratio, and the CPU time tracking adds per step, from the ``training-thread cost``
line a tracked run prints at its end: the training thread's own time per point, the sender
process's CPU time per value sent, and the CPU time of W&B's helper process ``wandb-core``; and the
training process's own CPU per step in the second epoch (metrics.jsonl's ``cpu_percent``), on minus
off. The sender's and wandb-core's CPU is what tracking takes from the machine's other cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def run_once(tracked: bool, steps: int, image_size: int, batch: int, uri: str, workdir: Path,
             every: int = 1, trackers: str = "both") -> tuple[float, float, tuple[float, float]]:
    run_dir = Path(tempfile.mkdtemp(prefix="tracked-" if tracked else "plain-", dir=workdir))
    args = ["-m", "hvdtrain", "--config", "debug", "data.synthetic=true", f"data.synthetic_samples={steps * batch}",
            f"data.image_size={image_size}", f"train.batch_size={batch}", f"train.steps_per_epoch={steps}",
            "train.epochs=2", "model.num_classes=10", f"output.dir={run_dir}", "checkpoint.keep=0"]
    if tracked:
        args.append(f"tracking.every_steps={every}")
        if trackers in ("both", "wandb"):
            args += ["tracking.wandb.enabled=true", "tracking.wandb.mode=offline"]
        if trackers in ("both", "mlflow"):
            args += ["tracking.mlflow.enabled=true", f"tracking.mlflow.tracking_uri={uri}",
                     "tracking.mlflow.experiment=tracking-cost"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_DATA_DIR": str(run_dir / "wd")}
    done = subprocess.run([str(BIN / "python"), *args], cwd=run_dir, env=env, capture_output=True, text=True,
                          timeout=1800)
    if done.returncode != 0:
        sys.exit(f"run failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if record["split"] == "train"]
    step_seconds = train[1]["seconds"] / steps
    # The process's CPU per step in the second epoch, every thread and the child processes
    # (wandb-core) included: what tracking adds there is its whole cost on the training machine.
    process_cpu = (train[1]["cpu_percent"] / 100 * step_seconds,
                   (train[1].get("workers_cpu_percent") or 0) / 100 * step_seconds)
    cpu = 0.0
    if tracked:
        found = re.search(r"training-thread cost (\d+) us per point; sender (?:process|thread) (\d+) us CPU per value "
                          r"\((\d+) values\)(?:; wandb-core ([\d.]+) s CPU)?", done.stdout)
        print(f"  {trackers}: {found.group(0) if found else done.stdout[-500:]}", flush=True)
        if found is None or "warning" in done.stdout.lower():
            sys.exit(f"tracking did not run cleanly:\n{done.stdout[-3000:]}")
        hook, sender, values = int(found.group(1)) * 1e-6, int(found.group(2)) * 1e-6, int(found.group(3))
        points = 2 * steps // every
        # All the CPU time tracking adds to the training machine over the run, per step: the training
        # thread's part, the sender's, and W&B's helper process (start-up included).
        cpu = (hook * points + sender * values + float(found.group(4) or 0)) / (2 * steps)
    return step_seconds, cpu, process_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mlflow-uri", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--every", type=int, default=1, help="tracking.every_steps (1: the worst case)")
    parser.add_argument("--trackers", default="both", choices=["both", "mlflow", "wandb"])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="tracking-cost-") as workdir:
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            result = {}
            for tracked in order:
                result[tracked] = run_once(tracked, args.steps, args.image_size, args.batch, args.mlflow_uri,
                                           Path(workdir), args.every, args.trackers)
            (off, _, (main_off, children_off)), (on, cpu, (main_on, children_on)) = result[False], result[True]
            rows.append((off, on, on / off, cpu, main_on - main_off, children_on - children_off))
            print(f"round {round_ + 1}: step off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, ratio {on / off:.3f}; "
                  f"CPU added by tracking {cpu * 1e3:.2f} ms per step ({100 * cpu / off:.3f}% of a step); training "
                  f"process CPU per step off {main_off * 1e3:.0f} ms, on {main_on * 1e3:.0f} ms; its child processes "
                  f"off {children_off * 1e3:.1f} ms, on {children_on * 1e3:.1f} ms", flush=True)
    off, on, ratio, cpu, main, children = (statistics.median(column) for column in zip(*rows))
    print(f"median: step off {off * 1e3:.1f} ms, on {on * 1e3:.1f} ms, ratio of rounds {ratio:.3f} "
          f"(from {min(r[2] for r in rows):.3f} to {max(r[2] for r in rows):.3f}); CPU added by tracking "
          f"{cpu * 1e3:.2f} ms per step = {100 * cpu / off:.3f}% of a step; per step, on minus off: training "
          f"process CPU {main * 1e3:.1f} ms ({100 * main / off:.2f}%), child processes {children * 1e3:.1f} ms "
          f"({100 * children / off:.2f}%)")


if __name__ == "__main__":
    main()
