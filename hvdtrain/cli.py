"""Command line: ``python -m hvdtrain [train] [--config FILE] [key=value ...]``.

Other subcommands are dispatched by name; ``train`` is the default.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Callable

from . import checkpoint
from .checkpoint import CheckpointError
from .config import ConfigError, apply_override, dump_yaml, from_dict, load_config, validate
from .data import DataError

USER_ERRORS = (ConfigError, DataError, CheckpointError)


def launcher_rank() -> int:
    """This process's rank as the launcher set it (before Horovod is initialized)."""
    for key in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if key in os.environ:
            try:
                return int(os.environ[key])
            except ValueError:
                pass
    return 0


def report_error(error: Exception) -> int:
    """One line on stderr, once per job.

    Errors that every rank hits alike (a bad config, a missing folder) would print once per rank;
    ranks other than 0 wait a moment first, and the launcher ends them when rank 0 exits, so the
    line from another rank only shows when that rank alone failed.
    """
    rank = launcher_rank()
    if rank != 0:
        time.sleep(3)
        print(f"hvdtrain: error on rank {rank} ({socket.gethostname()}): {error}", file=sys.stderr, flush=True)
    else:
        print(f"hvdtrain: error: {error}", file=sys.stderr, flush=True)
    return 2


def train_parser(prog: str = "hvdtrain") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Distributed ImageNet-style training with Horovod.",
        epilog="Overrides are dotted keys, e.g. train.epochs=3 data.dir=/data/imagenet optim.base_lr=0.1")
    parser.add_argument("--config", "-c", help="YAML config file, or the name of a shipped one (debug, demo, "
                        "imagenet_resnet50)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if args.print_config:
        if launcher_rank() == 0:
            print(dump_yaml(cfg), end="")
        return 0
    from .trainer import LostRank, Preempted, train  # imports Horovod: keep --print-config fast

    try:
        train(cfg)
    except Preempted as stop:
        return stop.exit_code
    except LostRank as lost:
        if lost.speak:
            print(lost, file=sys.stderr, flush=True)
        return 1
    return 0


def cmd_evaluate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdtrain evaluate", description="Validation loss, top-1 and top-5 of a checkpoint, as one JSON "
        "line. The model and data settings come from the checkpoint's config; overrides may change them "
        "(data.dir=..., runtime.threads=...).")
    parser.add_argument("--checkpoint", required=True, help="checkpoint file, e.g. runs/x/checkpoints/last.pt")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    path = Path(args.checkpoint)
    cfg = from_dict(checkpoint.load(path)["config"])
    for override in args.overrides:
        apply_override(cfg, override)
    validate(cfg)
    from .trainer import evaluate_checkpoint

    metrics = evaluate_checkpoint(cfg, path)
    if launcher_rank() == 0:
        print(json.dumps({"split": "val", "checkpoint": str(path), **metrics}), flush=True)
    return 0


def cmd_doctor(argv: list[str]) -> int:
    from . import doctor

    try:
        return doctor.main(argv)
    except doctor.DoctorError as error:
        print(f"hvdtrain doctor: error: {error}", file=sys.stderr, flush=True)
        return 2


def cmd_bench_data(argv: list[str]) -> int:
    from .bench_data import main as bench_data_main

    return bench_data_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from .bench import cmd_bench as run

    return run(argv)


def cmd_report(argv: list[str]) -> int:
    from .report import cmd_report as run

    return run(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train, "evaluate": cmd_evaluate, "bench": cmd_bench, "bench-data": cmd_bench_data,
    "report": cmd_report, "doctor": cmd_doctor,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = cmd_train
    if argv and argv[0] in COMMANDS:
        command = COMMANDS[argv.pop(0)]
    try:
        return command(argv)
    except USER_ERRORS as error:
        return report_error(error)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
