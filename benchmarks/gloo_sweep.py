"""Alternating sweep: DDP against hvdtrain with 2 ranks under the Gloo controller, with Horovod's
settings varied (benchmarks/results/gloo-gap_amd-epyc-2core_2026-11-24.md).

    python benchmarks/gloo_sweep.py --rounds 8 --variants b0,b25,b25+w

A variant is settings joined by "+": a number is HOROVOD_CYCLE_TIME in ms, fN the fusion buffer in
MiB (HOROVOD_FUSION_THRESHOLD), "a" pins Horovod's background thread (HOROVOD_THREAD_AFFINITY=0,1),
bN sets dist.bucket_mb=N (gradients allreduced in groups of N MB; b0 = fused per Horovod cycle),
"w" starts a cycle as soon as a tensor is queued (HOROVOD_CYCLE_WAKE_ON_ENQUEUE=1), "-w" keeps the
fixed cycle. "hvd" runs the hand-written loop with hvd.DistributedOptimizer instead of hvdtrain.
"section.key=value" passes that override to hvdtrain (runtime.cpu_affinity=none: threads left
unbound). "@DIR" takes Horovod from DIR first (a build installed with pip install --target DIR),
to set a patched or an older build against the installed one in the same rounds.

Every round runs DDP and each variant once, in an order rotated every round. The machine's speed
drifts between rounds (shared hosts), so besides each contender's median the sweep reports the
median over rounds of each variant's ratio to DDP in the same round ("paired"), the mean of those
ratios with its 95% confidence interval (Student's t over rounds), and the CPU seconds (user,
system) each job used. On a host that is slowed down from outside, the same work takes more CPU
seconds: a round is "steady" when every job in it used at most 5% more user CPU than that
contender's least, and "steady" is the paired median over those rounds only.
"""
import argparse
import resource
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import compare  # noqa: E402  (benchmarks/compare.py: the contenders' commands and environment)


def variant_run(variant: str, every: dict[str, tuple[int, list[str]]]) -> tuple[list[str], dict[str, str]]:
    settings = variant.split("+")
    if "hvd" in settings:
        ddp = every["ddp-2"][1]
        loop = ddp[ddp.index("--nproc_per_node") + 2:]
        command = [str(compare.BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
                   str(compare.BIN / "python"), *loop, "--horovod"]
        env = {"HOROVOD_CYCLE_TIME": "20"}  # what hvdtrain sets on CPU
    else:
        command, env = list(every["hvdtrain-2-gloo"][1]), {}
    for setting in settings:
        if setting == "hvd":
            continue
        if "=" in setting:
            command.append(setting)
        elif setting.startswith("@"):
            env["PYTHONPATH"] = f"{setting[1:]}:{compare.REPO}"
        elif setting.startswith("f"):
            env["HOROVOD_FUSION_THRESHOLD"] = str(int(setting[1:]) * 1024 * 1024)
        elif setting.startswith("b"):
            command.append(f"dist.bucket_mb={setting[1:]}")
        elif setting == "a":
            env["HOROVOD_THREAD_AFFINITY"] = "0,1"
        elif setting in ("w", "-w"):
            env["HOROVOD_CYCLE_WAKE_ON_ENQUEUE"] = "1" if setting == "w" else "0"
        else:
            env["HOROVOD_CYCLE_TIME"] = setting
    return command, env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--variants", default="b0,b25")
    parser.add_argument("--image-size", type=int, default=112)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    shape = argparse.Namespace(arch="resnet18", batch_size=16, image_size=args.image_size, threads=1, warmup_steps=3,
                               steps=args.steps)
    every = compare.contenders(shape)
    runs = [("ddp-2", every["ddp-2"][1], {})]
    runs += [(f"gloo-{v}", *variant_run(v, every)) for v in args.variants.split(",")]
    rates: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    cpu: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in runs}
    for round_ in range(args.rounds):
        for name, command, extra in runs[round_ % len(runs):] + runs[:round_ % len(runs)]:
            env = {**compare.job_env(1), **extra}
            began, before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
            rate = compare.run_once(command, env, 900)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            rates[name].append(rate)
            cpu[name].append((after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime))
            print(f"round {round_} {name:<16} {rate:7.2f} img/s  cpu user {cpu[name][-1][0]:5.1f} s "
                  f"sys {cpu[name][-1][1]:4.1f} s  ({time.time() - began:.0f} s, load {compare.load():.1f})",
                  flush=True)
    ddp = statistics.median(rates["ddp-2"])
    least = {name: min(u for u, _ in used) for name, used in cpu.items()}
    steady = [r for r in range(args.rounds) if all(cpu[name][r][0] <= 1.05 * least[name] for name in cpu)]
    print(f"\nsteady rounds: {steady}")
    print(f"{'contender':<16} {'median':>7} {'ratio':>6} {'paired':>7} {'mean paired':>15} {'steady':>7}  "
          f"{'user s':>6} {'sys s':>5}  per round")
    for name, values in rates.items():
        ratios = [v / d for v, d in zip(values, rates["ddp-2"])]
        paired = statistics.median(ratios)
        calm = f"{statistics.median(ratios[r] for r in steady):7.3f}" if steady else "      -"
        mean, half = compare.interval95(ratios)
        user = statistics.median(u for u, _ in cpu[name])
        system = statistics.median(s for _, s in cpu[name])
        print(f"{name:<16} {statistics.median(values):7.2f} {statistics.median(values) / ddp:6.3f} {paired:7.3f} "
              f"{mean:7.3f} +-{half:5.3f} {calm}  "
              f"{user:6.1f} {system:5.1f}  {[round(v, 2) for v in values]}")


if __name__ == "__main__":
    main()
