"""The train command's arguments: ``python -m hvdtrain`` (cli.py) parses them, and the Ray driver
(launch/ray.py) checks them before it starts a single rank. The commands' names (``SUMMARIES``)
and what tells a command from train arguments live here too, for the launchers' checks
(train/preflight.py), which must not import the CLI that imports them."""

from __future__ import annotations

import argparse

from .config import Config

CONFIG_DOC = "docs/config.md"
"""The config reference (every key, its type, default and meaning), in the hvdtrain repository."""


class UsageError(Exception):
    """A command line hvdtrain cannot make sense of, phrased as one line for the user."""


def train_parser(prog: str = "hvdtrain") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, description="Distributed ImageNet-style training with Horovod.",
        epilog="Overrides are dotted keys, e.g. train.epochs=3 data.dir=/data/imagenet optim.base_lr=0.1. "
        f"Every key, its type, default and meaning: {CONFIG_DOC}. Without --config, set data.dir (or "
        "data.synthetic=true); --config demo runs the built-in demo.")
    parser.add_argument("--config", "-c", help="YAML config file, or the name of a shipped one (debug, demo, "
                        "imagenet_resnet50, small_images, finetune)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config and what is in effect at the launch's ranks (batch per rank, "
                        "learning rate), and exit")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser


def require_data_choice(config_file: str | None, cfg: Config) -> None:
    """Stop a run that chose no data before it starts.

    The defaults alone are the ImageNet recipe (ResNet-50, 90 epochs) on the built-in demo
    images: hours of training nobody wants, which is what a bare ``python -m hvdtrain`` would
    start. A config file counts as a choice even when it leaves data.dir empty (the demo config
    does, on purpose); an empty data.dir override alone does not (``data.dir=$UNSET_VARIABLE``).
    Other tasks choose their data themselves: the rule is the default task's.
    """
    if cfg.task != "image_classification" or config_file or cfg.data.dir or cfg.data.synthetic:
        return
    raise UsageError("no data chosen: add --config demo (the built-in demo) or --config imagenet_resnet50 "
                     "data.dir=/path/to/imagenet (your data); without either this would train ResNet-50 for "
                     "90 epochs on the demo images")


# The commands of ``python -m hvdtrain`` (cli.py's COMMANDS runs them), each with its line of --help.
SUMMARIES: dict[str, str] = {
    "train": "train a model (the default command)",
    "evaluate": "validation loss, top-1 and top-5 of a checkpoint, as one JSON line",
    "bench": "training throughput of the real training step on synthetic data",
    "bench-data": "images per second of the training input pipeline alone",
    "report": "PNG plots and a text summary of a run's metrics.jsonl",
    "doctor": "check that hosts can train together (versions, packages, Horovod build, folders) and time allreduce",
    "prepare": "convert an ImageFolder into tar shards (WebDataset format) for training from shards or S3",
    "ray": "run a training job on a Ray cluster, one actor per rank (the ray extra)",
    "launch": "horovodrun with the ranks' exit code (75, 2, 1) and the cause as its last line",
    "slurm-script": "print a Slurm batch script of your own for this install (> my.sbatch)",
}
HELP_WORDS = ("-h", "--help", "help")


def looks_like_command(word: str) -> bool:
    """Whether a first argument that is no command was meant as one.

    Train arguments come without a command name, so only a bare word can be a mistyped command:
    options start with '-', overrides hold '=' and config keys and file names hold '.' or '/'
    (a key without '=' gets the override's own error, which says more than 'unknown command').
    """
    return bool(word) and not word.startswith("-") and not any(mark in word for mark in "=./")
