"""The train command's arguments: ``python -m hvdtrain`` (cli.py) parses them, and the Ray driver
(launch/ray.py) checks them before it starts a single rank."""

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
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
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
