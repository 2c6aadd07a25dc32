"""Alternating sweep: DDP against hvdtrain with 2 ranks under the Gloo controller, with Horovod's
settings varied (docs/benchmarks.md, "The Gloo gap").

    python benchmarks/gloo_sweep.py --rounds 3 --variants 20,60,150,a,60+a

A variant is settings joined by "+": a number is HOROVOD_CYCLE_TIME in ms, fN the fusion buffer in
MiB (HOROVOD_FUSION_THRESHOLD), "a" pins Horovod's background thread (HOROVOD_THREAD_AFFINITY=0,1),
bN adds dist.bucket_mb=N (gradients allreduced in groups of N MB; only on the gloo-buckets branch).
Every round runs DDP and each variant once, in an order rotated every round.
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import compare  # noqa: E402  (benchmarks/compare.py: the contenders' commands and environment)


def variant_run(variant: str, base: list[str]) -> tuple[list[str], dict[str, str]]:
    command, env = list(base), {}
    for setting in variant.split("+"):
        if setting.startswith("f"):
            env["HOROVOD_FUSION_THRESHOLD"] = str(int(setting[1:]) * 1024 * 1024)
        elif setting.startswith("b"):
            command.append(f"dist.bucket_mb={setting[1:]}")
        elif setting == "a":
            env["HOROVOD_THREAD_AFFINITY"] = "0,1"
        else:
            env["HOROVOD_CYCLE_TIME"] = setting
    return command, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--variants", default="20,60,150")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    shape = argparse.Namespace(arch="resnet18", batch_size=16, image_size=args.image_size, threads=1, warmup_steps=3,
                               steps=args.steps)
    every = compare.contenders(shape)
    runs = [("ddp-2", every["ddp-2"][1], {})]
    runs += [(f"gloo-{v}", *variant_run(v, every["hvdtrain-2-gloo"][1])) for v in args.variants.split(",")]
    samples: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    for round_ in range(args.rounds):
        for name, command, extra in runs[round_ % len(runs):] + runs[:round_ % len(runs)]:
            env = {**compare.job_env(1), **extra}
            began = time.time()
            rate = compare.run_once(command, env, 900)
            samples[name].append(rate)
            print(f"round {round_} {name:<14} {rate:7.2f} img/s ({time.time() - began:.0f}s, load {compare.load():.1f})",
                  flush=True)
    ddp = statistics.median(samples["ddp-2"])
    for name, rates in samples.items():
        print(f"{name:<14} median {statistics.median(rates):7.2f}  ratio {statistics.median(rates) / ddp:.3f}  {rates}")


if __name__ == "__main__":
    main()
