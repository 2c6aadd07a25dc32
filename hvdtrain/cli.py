"""Command line: ``python -m hvdtrain [COMMAND] [ARGS ...]``; ``python -m hvdtrain --help`` lists them.

``train`` is the default: arguments that do not start with a command name are train arguments
(``--config FILE``, ``key=value`` overrides). Only light modules are imported here, so that help
and one-line usage errors come at once; torch and Horovod are imported by the command that runs.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path
from typing import Callable

from . import environment, outcome
from .arguments import (
    CONFIG_DOC,
    HELP_WORDS,
    SUMMARIES,
    UsageError,
    looks_like_command,
    require_data_choice,
    train_parser,
)
from .comm import launcher_env as launcher
from .comm.launcher_env import NO_HOROVOD, horovod_missing
from .config import PACKAGED_CONFIGS, ConfigError
from .fault import signals
from .job_config import load_config


def launcher_rank() -> int:
    """This process's rank as the launcher set it (Horovod is not initialized yet, nor imported)."""
    return launcher.rank()


def cmd_train(argv: list[str]) -> int:
    args = train_parser().parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    if not args.print_config and cfg.dist.engine == "horovod" and horovod_missing():
        raise ConfigError(NO_HOROVOD)  # before torch is imported
    from .train.preflight import check_before_launch  # torch, not Horovod

    # What the ranks would refuse once they have the model (a weight-decay exemption that names no
    # parameter, say) is refused here, in one line, before Horovod starts.
    check_before_launch(cfg, forward=args.print_config)
    if args.print_config:
        from .train.in_effect import annotated_yaml  # the batch and rate in effect at the launch's ranks

        text = annotated_yaml(cfg)
        if launcher_rank() == 0:
            print(text, end="")
        return 0
    require_data_choice(args.config, cfg)
    environment.check_dependencies()  # a yaml.py of the user's hiding PyYAML: one line, not a traceback per rank
    from .api import train  # imports Horovod: keep --print-config fast

    code, _, _ = train(cfg)
    return code


def cmd_evaluate(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="hvdtrain evaluate", description="Validation loss, top-1 and top-5 of a checkpoint, as one JSON "
        "line. The model and data settings come from the checkpoint's config; overrides may change them "
        "(data.dir=..., runtime.threads=...).")
    parser.add_argument("--checkpoint", required=True, help="checkpoint file, e.g. runs/x/checkpoints/last.pt")
    parser.add_argument("--task", help="the task, when the checkpoint was written by a task of your own "
                        "(module:Class or path/to/file.py:Class): hvdtrain imports no code a checkpoint names")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = parser.parse_args(argv)
    from .api import evaluate_checkpoint_file  # imports torch: after the arguments are checked

    path = Path(args.checkpoint)
    metrics = evaluate_checkpoint_file(path, args.overrides, args.task, how="--task my_task.py:MyTask or module:Class")
    if launcher_rank() == 0:
        print(json.dumps({"split": "val", "checkpoint": str(path), **metrics}), flush=True)
    return 0


def cmd_doctor(argv: list[str]) -> int:
    from .tools import doctor

    try:
        return doctor.main(argv)
    except doctor.DoctorError as error:
        print(f"hvdtrain doctor: error: {error}", file=sys.stderr, flush=True)
        return 2


def cmd_bench_data(argv: list[str]) -> int:
    from .tools.bench_data import main as bench_data_main

    return bench_data_main(argv)


def cmd_prepare(argv: list[str]) -> int:
    from .tools.prepare import main as prepare_main

    return prepare_main(argv)


def cmd_bench(argv: list[str]) -> int:
    from .tools.bench import cmd_bench as run

    return run(argv)


def cmd_ray(argv: list[str]) -> int:
    from .launch.ray import main as ray_main  # imports Ray only once the arguments are checked

    return ray_main(argv)


def cmd_launch(argv: list[str]) -> int:
    from .launch.horovodrun import main as launch_main

    return launch_main(argv)


def cmd_slurm_script(argv: list[str]) -> int:
    from .launch.slurm_script import main as slurm_script_main

    return slurm_script_main(argv)


def cmd_report(argv: list[str]) -> int:
    from .tools.report import cmd_report as run

    return run(argv)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": cmd_train, "evaluate": cmd_evaluate, "bench": cmd_bench, "bench-data": cmd_bench_data,
    "report": cmd_report, "doctor": cmd_doctor, "prepare": cmd_prepare, "ray": cmd_ray, "launch": cmd_launch,
    "slurm-script": cmd_slurm_script,
}




def overview() -> str:
    """The text of ``python -m hvdtrain --help``: every command, then how to train."""
    width = max(map(len, COMMANDS))
    commands = "\n".join(f"  {name:<{width}}  {SUMMARIES[name]}" for name in COMMANDS)
    shipped = ", ".join(sorted(path.stem for path in PACKAGED_CONFIGS.glob("*.yaml")))
    return f"""usage: python -m hvdtrain [COMMAND] [ARGS ...]

Distributed ImageNet-style training with Horovod: one process alone, or one per GPU or CPU slot
under horovodrun or mpirun.

commands (train is the default: it runs when the first argument is not a command):
{commands}

train:
  python -m hvdtrain [train] [--config FILE] [--print-config] [key=value ...]
  --config, -c FILE  YAML config file, or the name of a shipped one ({shipped})
  --print-config     print the resolved config, what is in effect at the launch's ranks, and exit
  key=value          override one config key, e.g. train.epochs=3 data.dir=/data/imagenet
  Without --config, name the data with data.dir=... (or data.synthetic=true).

examples:
  python -m hvdtrain --config demo                    # the built-in demo: resnet18, a few minutes on CPU
  python -m hvdtrain --config imagenet_resnet50 data.dir=/data/imagenet
  horovodrun -np 4 -H localhost:4 python -m hvdtrain --config demo train.epochs=2
  python -m hvdtrain --config demo --print-config     # the resolved config, nothing run

Every config key, its type, default and meaning: {CONFIG_DOC}
A command's own options: python -m hvdtrain COMMAND --help (or python -m hvdtrain help COMMAND)
This install's version: python -m hvdtrain --version
"""


def cmd_help(argv: list[str]) -> int:
    """``help`` alone prints the overview; ``help COMMAND`` that command's own ``--help``."""
    if not argv:
        print(overview(), end="")
        return 0
    if argv[0] not in COMMANDS:
        raise UsageError(unknown_command(argv[0]))
    try:
        return COMMANDS[argv[0]](["--help"])
    except SystemExit as done:  # argparse exits after printing the help
        return done.code if isinstance(done.code, int) else 0


VERSION_WORDS = ("--version", "-V")


def cmd_version(argv: list[str]) -> int:
    """``--version``: hvdtrain's version, and where this install is (a shared one, a checkout)."""
    from . import __version__

    print(f"hvdtrain {__version__} ({Path(__file__).resolve().parent}, Python {sys.version.split()[0]})")
    return 0


def unknown_command(word: str) -> str:
    """One line for a word that is no command, with the nearest command or config to use instead."""
    if (PACKAGED_CONFIGS / f"{word}.yaml").is_file():  # 'python -m hvdtrain demo'
        return f"unknown command '{word}' (did you mean '--config {word}'?)"
    close = difflib.get_close_matches(word, list(COMMANDS) + ["help"], n=1, cutoff=0.6)
    if close:
        return f"unknown command '{word}' (did you mean '{close[0]}'?)"
    return f"unknown command '{word}' (commands: {', '.join(COMMANDS)}; see python -m hvdtrain --help)"


def pick_command(argv: list[str]) -> tuple[Callable[[list[str]], int], list[str]]:
    """The command to run and its arguments; train when the first argument names none."""
    if not argv:
        return cmd_train, []
    first, rest = argv[0], argv[1:]
    if first in COMMANDS:
        return COMMANDS[first], rest
    if first in HELP_WORDS:
        return cmd_help, rest
    if first in VERSION_WORDS:
        return cmd_version, rest
    if looks_like_command(first):
        raise UsageError(unknown_command(first))
    return cmd_train, argv


def environment_problem(error: Exception) -> environment.EnvironmentProblem | None:
    """An exception that is the user's environment's doing (a module of theirs hiding an installed
    one, a file they may not read), as the one line to report; else None (a crash: its traceback)."""
    if isinstance(error, PermissionError):
        return environment.EnvironmentProblem(environment.permission_line(error))
    line = environment.explain(error)
    return environment.EnvironmentProblem(line) if line else None


# Commands that act on a stop signal caught during start-up (fault/signals.py): train stops at its
# first step with a checkpoint, launch hands it to the ranks. The others end on it, as they would have.
KEEP_EARLY_STOPS = ("train", "launch")


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own (python -m hvdtrain caught them already): not a caller's
        signals.catch()
    argv = list(sys.argv[1:] if argv is None else argv)
    code = outcome.EXIT_CRASH
    try:
        command, args = pick_command(argv)
        if command not in [COMMANDS[name] for name in KEEP_EARLY_STOPS]:
            signals.release()
        code = command(args)
        return code
    except KeyboardInterrupt:
        outcome.note_cause("interrupted (Ctrl-C)")
        code = outcome.EXIT_INTERRUPTED
        return code
    except Exception as error:
        if isinstance(error, outcome.user_errors()):
            code = outcome.report_error(error)
            return code
        problem = environment_problem(error)
        if problem is not None:
            code = outcome.report_error(problem)
            return code
        outcome.crash_cause(error)
        raise
    finally:
        outcome.write_exit_record(code)


if __name__ == "__main__":
    sys.exit(main())
