"""What a short step's waits cost: Horovod training steps of the digits model on 2 CPU ranks, with
no stop agreement, one at every step, one about every 0.5 s (hvdtrain's), and that with the
gradients waited for asleep (hvdtrain's wait on CPU), against DDP.

    python benchmarks/stop_agreement.py --rounds 3                  # 600 timed steps per run
    python benchmarks/stop_agreement.py --rounds 3 --bind rank      # each rank's threads on its own core
    python benchmarks/stop_agreement.py --rounds 1 --steps 30 --warmup-steps 5   # the plumbing alone (tests)

Contenders, each a fresh `horovodrun -np 2 -H localhost:2 --gloo` job (torchrun for ddp), in an
order that rotates from round to round:
  none        the gradients' allreduce only (comm/dist.distributed_optimizer: one group, as hvdtrain
              builds it), waited for in Horovod's synchronize (which spins)
  every-step  plus fault/preemption.StopRequest.agreed(wait=False) at every step boundary, each
              answer read at the next (interval_seconds=0: what hvdtrain did before)
  sparse      plus the same call with hvdtrain's interval (AGREE_EVERY_SECONDS): an agreement about
              every half second, read at the next such boundary
  hvdtrain    sparse, with the gradients waited for asleep (comm/dist.synchronize(quiet=True), what
              hvdtrain's step does on CPU)
  ddp         torch DistributedDataParallel over Gloo, the same model, batch and optimizer (unbound)

The model is examples/from_ddp's Net (8x8 digits), batch 32 per rank, SGD with momentum, one
thread per rank, on one synthetic batch; steps are timed after 50 untimed ones (``--warmup-steps``).
``--bind rank`` binds every thread of each Horovod rank to its own core after Horovod starts, as
``runtime.cpu_affinity=auto`` does on a CPU host with several ranks (launch/placement.py). Printed
per run: milliseconds per step on rank 0 and the agreements sent; then each contender's median and
its paired ratio to `none`. Results go to OUT/stop_agreement.json.
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
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CONTENDERS = ("none", "every-step", "sparse", "hvdtrain", "ddp")


def child(args: argparse.Namespace) -> None:
    sys.path[:0] = [str(REPO), str(REPO / "examples" / "from_ddp")]
    import torch
    import torch.nn.functional as F
    from hvdtrain_digits import Net

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    images, labels = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
    if args.child == "ddp":
        import torch.distributed as torch_dist
        from torch.nn.parallel import DistributedDataParallel

        torch_dist.init_process_group("gloo")
        rank, forward = torch_dist.get_rank(), DistributedDataParallel(model)
        agree, quiet = None, False
    else:
        from hvdtrain.comm import dist
        from hvdtrain.fault.preemption import StopRequest

        dist.init(gpu=False)  # with the cycle settings hvdtrain runs Horovod with on CPU
        import horovod.torch as hvd

        rank, forward = hvd.rank(), model
        if args.bind == "rank":
            from hvdtrain.launch.placement import bind_threads

            cores = sorted(os.sched_getaffinity(0))
            bind_threads([cores[rank % len(cores)]])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # As hvdtrain builds it on CPU: one 25 MB group (this model's gradients: one group), no compression.
        optimizer = dist.distributed_optimizer(optimizer, model.named_parameters(), compression="none",
                                               backward_passes_per_step=1, op="average", bucket_mb=25)
        stop = StopRequest()
        if args.child == "every-step":
            stop.interval_seconds = 0.0
        agree = None if args.child == "none" else stop
        quiet = args.child == "hvdtrain"
        sent = [0]
        if agree is not None:
            send = dist.allreduce_sum_async

            def counted(tensor, name):
                sent[0] += 1
                return send(tensor, name)
            dist.allreduce_sum_async = counted

    def steps(count: int) -> None:
        for _ in range(count):
            optimizer.zero_grad()
            F.cross_entropy(forward(images), labels).backward()
            if quiet:
                dist.synchronize(optimizer, quiet=True)
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
            if agree is not None and agree.agreed(wait=False):
                raise SystemExit("a stop nobody asked for")
        if agree is not None:
            agree.settle()

    steps(args.warmup_steps)
    if agree is not None:
        sent[0] = 0  # the timed steps' agreements
    start = time.perf_counter()
    steps(args.steps)
    seconds = time.perf_counter() - start
    if rank == 0:
        agreements = sent[0] if agree is not None else 0  # sent by rank 0, as by every rank
        result = {"ms_per_step": 1000 * seconds / args.steps, "steps": args.steps, "agreements": agreements}
        print(f"RESULT {json.dumps(result)}", flush=True)


def run_one(name: str, args: argparse.Namespace, env: dict[str, str]) -> dict:
    me = [str(BIN / "python"), str(Path(__file__).resolve()), "--child", name, "--steps", str(args.steps),
          "--warmup-steps", str(args.warmup_steps), "--bind", args.bind]
    if name == "ddp":
        command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", *me[1:]]
    else:
        command = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo", *me]
    with tempfile.TemporaryDirectory(prefix="stop_agreement_") as folder:
        result = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    found = re.search(r"RESULT (\{.*\})", result.stdout + result.stderr)
    if result.returncode != 0 or not found:
        raise SystemExit(f"{name} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(found.group(1))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=600, help="timed steps per run, after the untimed ones")
    parser.add_argument("--warmup-steps", type=int, default=50, help="untimed steps before them")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--bind", choices=("none", "rank"), default="none",
                        help="rank: each Horovod rank's threads on its own core (runtime.cpu_affinity=auto)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--child", choices=CONTENDERS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return {}
    names = [name for name in args.contenders.split(",") if name]
    unknown = sorted(set(names) - set(CONTENDERS))
    if unknown or "none" not in names:
        raise SystemExit(f"--contenders: {', '.join(unknown) or 'none is missing'}; choose among "
                         f"{', '.join(CONTENDERS)} (none is the baseline of the ratios)")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for index in range(args.rounds):
        order = names[index % len(names):] + names[:index % len(names)]
        for name in order:
            runs[name].append(run_one(name, args, env))
        print(f"round {index + 1}: " + ", ".join(
            f"{name} {runs[name][-1]['ms_per_step']:.2f} ms ({runs[name][-1]['agreements']} agreements)"
            for name in names),
            flush=True)
    medians = {name: statistics.median(run["ms_per_step"] for run in runs[name]) for name in names}
    ratios = {name: [run["ms_per_step"] / base["ms_per_step"] for run, base in zip(runs[name], runs["none"])]
              for name in names if name != "none"}
    for name in names:
        paired = f", paired ratio to none: median {statistics.median(ratios[name]):.3f}" if name in ratios else ""
        print(f"{name:>11}: median {medians[name]:.2f} ms/step{paired}")
    result = {"steps": args.steps, "warmup_steps": args.warmup_steps, "rounds": args.rounds, "bind": args.bind,
              "runs": runs, "median_ms": medians, "paired_ratios_to_none": ratios}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stop_agreement.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
