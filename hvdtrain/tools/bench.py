"""``python -m hvdtrain bench``: images per second of the trainer's own training step.

Synthetic batches of the configured size go through ``trainer.setup`` (the same Horovod
DistributedOptimizer, compression, AMP/GradScaler and gradient accumulation) and
``engine.Epoch`` (the same step): nothing is copied, so what is measured is what
``python -m hvdtrain`` runs, minus the input pipeline. Warm-up steps are run and thrown away
(allocator, cuDNN autotuning, torch.compile, Horovod's response cache); then ``--repeats`` timed
runs of ``--steps`` optimizer steps each give a mean and a 95% interval per rank and for the job.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..config import Config
from ..job_config import load_config
from ..observe.phases import LABELS

# Two-sided 95% quantiles of Student's t distribution by degrees of freedom (1..30).
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
         2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
         2.052, 2.048, 2.045, 2.042)

FORCED = ["data.synthetic=true", "checkpoint.resume=never", "output.progress=false", "output.tensorboard=false",
          "runtime.stats_interval=0"]


def interval95(values: list[float]) -> tuple[float, float]:
    """Mean and half-width of its 95% confidence interval (Student's t; 0 for a single value)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, 0.0
    dof = len(values) - 1
    t = T_975[dof - 1] if dof <= len(T_975) else 1.96
    return mean, t * statistics.stdev(values) / math.sqrt(len(values))


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hvdtrain bench",
        description="Training throughput of hvdtrain's real step on synthetic data, per rank and in total. "
                    "Run under horovodrun/mpirun/srun for several ranks.",
        epilog="Example: horovodrun -np 2 -H localhost:2 python -m hvdtrain bench model.arch=resnet18 "
               "train.batch_size=16 runtime.threads=1")
    parser.add_argument("--config", "-c", help="YAML config file or the name of a shipped one")
    parser.add_argument("--warmup-steps", type=int, default=5, help="optimizer steps run before timing (default 5)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed repeat (default 20)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats; the 95%% interval is over them "
                        "(default 5)")
    parser.add_argument("--json", help="also write the results to this JSON file (rank 0)")
    parser.add_argument("--link-gbit", type=float, metavar="GBIT",
                        help="allreduce bandwidth between hosts in Gbit/s (hvdtrain doctor's bus bandwidth): also "
                             "print the scaling limit at 2-32 nodes over it, from this run's step time")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def synchronize(device: torch.device) -> None:
    """CUDA kernels run asynchronously: a timer must wait for them."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_bench(cfg: Config, warmup_steps: int, steps: int, repeats: int) -> dict[str, Any]:
    """Run the benchmark on this rank; every rank returns the same summary."""
    from ..train.resume import resume
    from ..train.run import release, setup

    run = setup(cfg, claim_folder=False)
    try:
        resume(run)  # checkpoint.resume=never: every rank starts from rank 0's weights
        return timed_run(run, cfg, warmup_steps, steps, repeats)
    finally:
        release(run)


def timed_run(run: Any, cfg: Config, warmup_steps: int, steps: int, repeats: int) -> dict[str, Any]:
    """The benchmark's measurements of a run set up and resumed."""
    from ..comm import dist
    from ..data.synthetic import SyntheticBatches
    from ..observe.phases import PHASES, epoch_phases
    from ..train.builders import compression_for
    from ..train.engine import Epoch
    from ..train.save import audit_ranks

    state, settings = run.state, run.settings
    passes = settings.backward_passes_per_step
    # With ema.decay > 0 the EMA update runs after every optimizer step, as in training; its own time
    # is measured so that its share of the step can be reported.
    ema_seconds = [0.0]
    if run.ema is not None:
        def timed_ema(state_: Any, hook=run.ema.after_optimizer_step) -> None:
            synchronize(settings.device)
            start = time.perf_counter()
            hook(state_)
            synchronize(settings.device)
            ema_seconds[0] += time.perf_counter() - start

        settings.after_optimizer_step[:] = [timed_ema if h == run.ema.after_optimizer_step else h
                                            for h in settings.after_optimizer_step]
    batch = cfg.train.batch_size
    rank = dist.rank()

    def batches(count: int):
        # The task's own batches (synthetic images for image classification), loaded before timing.
        synthetic = run.task.bench_batches(count * passes, rank)
        if settings.device.type == "cuda" and isinstance(synthetic, SyntheticBatches):
            # as the trainer's loaders do on CUDA: asynchronous copies
            synthetic.images, synthetic.labels = synthetic.images.pin_memory(), synthetic.labels.pin_memory()
        return synthetic

    audit_every = cfg.runtime.audit_every if cfg.runtime.audit != "off" else 0

    def timed_epoch(batches, count: int) -> dict[str, Any]:
        # An Epoch runs from the position in the epoch up to ``count``: every call starts from
        # step 0, or the warm-up would eat the first repeat and later repeats run nothing.
        state.position.start_epoch(0)
        epoch = Epoch(state, settings, batches, count, dist.allreduce_sum)
        for _ in epoch:
            # runtime.audit_every: the cross-rank audit inside the timed steps, as training runs it.
            if audit_every and state.position.step % audit_every == 0:
                audit_ranks(run, f"global step {state.position.step}")
        metrics = epoch.metrics()
        if metrics["steps"] != count:
            raise RuntimeError(f"bench: {metrics['steps']} of {count} steps ran")
        return metrics

    if warmup_steps > 0:
        timed_epoch(batches(warmup_steps), warmup_steps)
    ema_seconds[0] = 0.0
    timed_seconds = 0.0
    local_rates, totals, steps_run, samples_run, rank_phases = [], [], [], [], []
    timed = batches(steps)
    for _ in range(repeats):
        synchronize(settings.device)
        start = time.perf_counter()
        # Epoch.metrics() is a cross-rank reduction of its metrics, so every rank's
        # clock stops after the last rank's last step.
        metrics = timed_epoch(timed, steps)
        synchronize(settings.device)
        seconds = time.perf_counter() - start
        timed_seconds += seconds
        local_rates.append(steps * passes * batch / seconds)
        slowest = max(dist.allgather_object(seconds, name="bench_seconds"))
        totals.append(metrics["samples"] / slowest)
        steps_run.append(metrics["steps"])
        samples_run.append(metrics["samples"])
        rank_phases.append(metrics["rank_phases"])
    per_rank = dist.allgather_object(local_rates, name="bench_rates")
    audit_cost = time_audit(run, timed_seconds / (steps * repeats)) if cfg.runtime.audit != "off" else {}
    step_phases = {}
    if settings.phase_timing:
        mine = {phase: sum(r[phase] * r["steps"] for r in rank_phases) for phase in PHASES}
        mine["steps"] = sum(r["steps"] for r in rank_phases)
        mine = {phase: mine[phase] / max(1, mine["steps"]) if phase in PHASES else mine[phase] for phase in mine}
        gathered = dist.allgather_object({**mine, "rank": rank, "host": ""}, name="bench_phases")
        step_phases = {k[len("phase_"):]: v for k, v in epoch_phases(gathered).items() if k.startswith("phase_")}
    total_mean, total_half = interval95(totals)
    ema: dict[str, Any] = {}
    if run.ema is not None:
        # Rank 0's share: the update is the same arithmetic on every rank.
        ema = {"ema_every_steps": cfg.ema.every_steps, "ema_update_fraction": ema_seconds[0] / timed_seconds,
               "ema_seconds_per_step": ema_seconds[0] / (steps * repeats)}
    return {
        "task": run.task.name, "unit": getattr(run.task, "unit", "samples"),
        "arch": cfg.model.arch, "image_size": cfg.data.image_size, "batch_size": batch,
        "backward_passes_per_step": passes, "world_size": dist.size(), "controller": dist.controller(),
        "device": settings.device.type, "threads_per_rank": torch.get_num_threads(),
        "compression": compression_for(cfg, settings.device),
        "amp": cfg.amp.dtype if cfg.amp.enabled else "off", "compile": cfg.runtime.compile,
        "warmup_steps": warmup_steps, "steps": steps, "repeats": repeats,
        "steps_run": steps_run, "samples_run": samples_run,  # per repeat: what was really timed
        "per_rank": [{"rank": r, "images_per_sec": interval95(rates)[0], "ci95": interval95(rates)[1],
                      "repeats": rates} for r, rates in enumerate(per_rank)],
        "images_per_sec": total_mean, "ci95": total_half, "repeats_images_per_sec": totals,
        "step_seconds": timed_seconds / (steps * repeats),  # this rank's clock, which waits for the last rank
        "gradient_bytes": sum(p.numel() * p.element_size() for p in state.model.parameters() if p.requires_grad),
        "phases": step_phases,  # fraction of step time by phase, mean over ranks (observe/phases.py)
        **ema, **audit_cost,
    }


def time_audit(run: Any, step_seconds: float, calls: int = 5) -> dict[str, Any]:
    """What one cross-rank audit costs (fingerprint, gather, compare; the median of ``calls``), as
    seconds and as a fraction of one timed step."""
    from ..comm import dist
    from ..fault.audit import audit, fingerprint

    times = []
    for _ in range(calls):
        dist.barrier()
        start = time.perf_counter()
        audit(run.state, "bench", floating_buffers=True)
        times.append(time.perf_counter() - start)
    seconds = max(dist.allgather_object(sorted(times)[calls // 2], name="bench_audit"))
    return {"audit_seconds": seconds, "audit_step_fraction": seconds / step_seconds,
            "audit_values": len(fingerprint(run.state, True)[0])}


def format_report(result: dict[str, Any]) -> list[str]:
    unit = result.get("unit", "img")
    size = f" {result['image_size']}px" if unit == "img" else ""
    lines = [
        f"bench: {result['arch']}{size}, batch {result['batch_size']}/rank x "
        f"{result['backward_passes_per_step']} passes x {result['world_size']} ranks ({result['controller']} "
        f"controller), {result['device']}, {result['threads_per_rank']} threads/rank, compression "
        f"{result['compression']}, amp {result['amp']}, compile {str(result['compile']).lower()}",
        f"bench: {result['warmup_steps']} warm-up steps excluded; {result['repeats']} repeats x "
        f"{result['steps']} steps timed",
    ]
    for row in result["per_rank"]:
        lines.append(f"bench: rank {row['rank']}: {row['images_per_sec']:.2f} {unit}/s "
                     f"+- {row['ci95']:.2f} (95% interval)")
    lines.append(f"bench: total: {result['images_per_sec']:.2f} {unit}/s +- {result['ci95']:.2f} "
                 f"(95% interval over {result['repeats']} repeats)")
    if result.get("phases"):
        lines.append("bench: step time: " + ", ".join(f"{LABELS[phase]} {100 * share:.1f}%"
                                                      for phase, share in result["phases"].items()))
    if "ema_update_fraction" in result:
        lines.append(f"bench: model EMA update (every {result['ema_every_steps']} step(s)): "
                     f"{1000 * result['ema_seconds_per_step']:.2f} ms per step, "
                     f"{100 * result['ema_update_fraction']:.2f}% of the step time")
    if "audit_seconds" in result:
        lines.append(f"bench: cross-rank audit: {1000 * result['audit_seconds']:.2f} ms each "
                     f"({result['audit_values']} values), {100 * result['audit_step_fraction']:.2f}% of one step; "
                     f"by default it runs at checkpoints and epoch ends only (runtime.audit_every=N: every N steps)")
    if result.get("forecast"):
        lines += ["bench: " + line for line in result["forecast"]]
    lines.append(f"images_per_sec={result['images_per_sec']:.2f}")
    return lines


def add_forecast(result: dict[str, Any], link_gbit: float) -> dict[str, Any]:
    """The scaling limit over a link of ``link_gbit`` from the run's step time and gradient bytes
    (observe/forecast.py), as lines and figures for the report and the JSON."""
    from ..observe.forecast import GBIT, NODES, forecast, format_forecast

    step, grads, link = result["step_seconds"], result["gradient_bytes"], link_gbit * GBIT
    lines = format_forecast(step, grads, link, prefix="")
    if result["world_size"] > 1:
        lines.append(f"the step time is that of this run's {result['world_size']} ranks, their own communication "
                     f"included: run bench on one node's ranks for that node's step")
    table = {name: [{"nodes": p.nodes, "factor": p.factor, "comm_seconds": p.comm_seconds,
                     "bottleneck": p.bottleneck} for p in points]
             for name, points in forecast(step, grads, link, NODES).items()}
    return {"link_gbit": link_gbit, "forecast": lines, "forecast_table": table}


def cmd_bench(argv: list[str]) -> int:
    from ..config import ConfigError

    args = bench_parser().parse_intermixed_args(argv)
    for flag, value, low in (("--warmup-steps", args.warmup_steps, 0), ("--steps", args.steps, 1),
                             ("--repeats", args.repeats, 1)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if args.link_gbit is not None and not args.link_gbit > 0:
        raise ConfigError(f"--link-gbit must be > 0 (the bandwidth between hosts in Gbit/s), got {args.link_gbit}")
    cfg = load_config(args.config, list(args.overrides) + FORCED)
    result = run_bench(cfg, args.warmup_steps, args.steps, args.repeats)
    if args.link_gbit:
        result.update(add_forecast(result, args.link_gbit))

    from ..comm import dist

    if dist.is_primary():
        for line in format_report(result):
            print(line, flush=True)
        if args.json:
            path = Path(args.json)
            from ..ownership import UMASK, own_folder, write_atomic

            own_folder(path.parent, UMASK, what="folder of --json", fix="give --json a path in a folder of yours")
            write_atomic(path, json.dumps(result, indent=1) + "\n", UMASK)  # never through a planted link
    return 0
