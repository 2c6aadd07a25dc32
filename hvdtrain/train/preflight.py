"""The checks a rank would make of the model and the task, made before any rank starts.

A config can be valid key by key and still be refused by the ranks once they have built the model:
a weight-decay exemption or a freeze pattern that names no parameter, a classifier head that is not
there, a metric the task does not declare for best.pt or train.target. On the ranks that is tens of
seconds in (the launcher, Horovod, the file index, the loaders), with the launcher's output around
it. Here it is the same one line, before the launch: the model is built on the meta device (its
parameter names and shapes, no memory, no initialization cost) and the same functions the ranks
call refuse what they would refuse.

The input size is checked too: against the smallest size torchvision records for the model (every
caller), and, before a launch (``--print-config``, ``hvdtrain launch``, ``hvdtrain ray``), by one
forward of the configured size on the meta device, which catches what no record says (a ViT's one
size, a timm model); a model that cannot take the size stops in one line naming the smallest it takes.

Called by ``--print-config``, by each rank's ``train`` command before it imports Horovod, by
``hvdtrain launch`` and ``hvdtrain ray`` on the command they start (``check_train_args``), and by
``fit``/``fit_model`` before Horovod starts. Only the built-in image task is built here: the
recommender's model depends on its data, and a task of one's own may build anything.
"""

from __future__ import annotations

import os
from typing import Mapping

from ..config import Config, ConfigError

# Input sizes tried on the meta device, in order, to name the smallest one a model takes when the
# configured one fails and torchvision's weights record no minimum for it (timm's models, a ViT's
# one fixed size).
TRIED_SIZES = (32, 64, 96, 128, 160, 192, 224, 256, 299, 320, 384, 448, 512)


def input_sizes(cfg: Config) -> list[tuple[str, int]]:
    """(key, pixels) of the images the model sees, smallest first: the training size (the smallest
    of progressive resizing) and the validation crop."""
    data = cfg.data
    train = ("data.min_res", data.min_res) if data.min_res else ("data.image_size", data.image_size)
    val = ("data.val_image_size", data.val_image_size) if data.val_image_size else ("data.image_size", data.image_size)
    return sorted({train, val}, key=lambda item: item[1])


def recorded_min_size(arch: str) -> int | None:
    """The smallest input side torchvision's weights for ``arch`` record (``meta['min_size']``: 63
    for alexnet, 75 for inception_v3; the least over its weights, which may be built for larger
    sizes), or None (no such record, a timm model)."""
    from torchvision import models

    try:
        weights = list(models.get_model_weights(arch))
    except (KeyError, ValueError):
        return None
    sides = [min(w.meta["min_size"]) for w in weights if "min_size" in w.meta]
    return min(sides) if sides else None


def forward_fails(model, size: int) -> str | None:
    """The first line of the error one forward of a ``size`` px image raises on the meta device (eval
    mode: no batch statistics), or None where it passes."""
    import torch

    try:
        model(torch.empty(1, 3, size, size, device="meta"))
    except Exception as error:  # noqa: BLE001 -- any failure is the model's answer to this size
        return (str(error).splitlines() or [type(error).__name__])[0][:160]
    return None


def size_problem(cfg: Config, model, forward: bool) -> str | None:
    """One line where the model cannot take the configured input size, naming the smallest it takes:
    torchvision's recorded minimum (no forward), then, with ``forward``, one forward of the smallest
    configured size on the meta device (a size the model refuses for another reason: a ViT's
    fixed size, a timm model)."""
    arch = cfg.model.arch
    (key, size), *_ = input_sizes(cfg)
    smallest = recorded_min_size(arch)
    if smallest and size < smallest:
        return (f"model.arch={arch} does not take {size} px images ({key}={size}): the smallest size it takes is "
                f"{smallest} px; set {key}={smallest} or more, or choose a model for small images")
    if not forward:
        return None
    model.eval()
    for key, size in input_sizes(cfg):
        failed = forward_fails(model, size)
        if failed is None:
            continue
        works = next((side for side in TRIED_SIZES if side != size and forward_fails(model, side) is None), None)
        if works is None:
            return None  # no size helps: not a size problem the meta device can tell; the ranks report it
        return (f"model.arch={arch} does not take {size} px images ({key}={size}; its forward says: {failed}): the "
                f"smallest of {', '.join(map(str, TRIED_SIZES))} px it takes is {works} px; set {key}={works}")
    return None


def check_before_launch(cfg: Config, forward: bool = False) -> None:
    """Raise the ConfigError a rank would raise at start-up on this config's model and task settings.
    ``forward`` (before a launch, not on each rank: seconds on a loaded host): also run the model on
    the meta device at the configured input size (size_problem)."""
    if cfg.task != "image_classification":
        return
    import torch

    from ..model.build import build_model
    from ..model.finetune import apply_freeze
    from ..optim.build import optimizer_groups
    from ..tasks import metric_direction
    from ..tasks.image_classification import ImageClassification

    task = ImageClassification(cfg)
    metric_direction(task, cfg.checkpoint.best_metric or task.best_metric, "checkpoint.best_metric")
    if cfg.train.target_metric:
        metric_direction(task, cfg.train.target_metric, "train.target_metric")
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, cfg.model.num_classes or 1000)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 -- a model that cannot be built on the meta device: the ranks check it
        return
    apply_freeze(model, cfg.model.freeze, cfg.model.arch)
    optimizer_groups(model, cfg.optim)
    problem = size_problem(cfg, model, forward)
    if problem:
        raise ConfigError(problem)


def check_train_args(train_args: list[str], prog: str, own_tasks: bool = True) -> Config | None:
    """A train command's arguments (``--config FILE``, ``key=value``...) as its ranks will read them,
    checked here: the config, the data choice and ``check_before_launch``. ``own_tasks=False``: a
    config whose task is not a shipped one is left to the ranks (its module may be importable only
    where they run: another PYTHONPATH, files on the compute nodes). Returns the config checked
    (None: left to the ranks)."""
    from ..arguments import require_data_choice, train_parser
    from ..job_config import load_config
    from ..tasks.registry import TASKS

    args = train_parser(prog).parse_args(train_args)
    if not own_tasks and load_config(args.config, args.overrides, check=False).task not in TASKS:
        return None
    cfg = load_config(args.config, args.overrides)
    require_data_choice(args.config, cfg)
    check_before_launch(cfg, forward=True)
    return cfg


# Interpreter options without a value that may come before ``-m hvdtrain`` (-P: the working folder
# is not put on sys.path; -u: unbuffered; -B, -E, -s, -I, -O).
PYTHON_FLAGS = ("-P", "-u", "-B", "-E", "-s", "-I", "-O", "-OO")


def hvdtrain_train_args(command: list[str]) -> list[str] | None:
    """The train arguments of a command that starts hvdtrain's train command (``python -m hvdtrain
    [train] ARGS``, ``hvdtrain [train] ARGS``), or None for any other program or hvdtrain command."""
    if not command:
        return None
    name = os.path.basename(command[0])
    options = 1
    while options < len(command) and command[options] in PYTHON_FLAGS:  # python -P -u -m hvdtrain
        options += 1
    if name.startswith("python") and command[options:options + 2] == ["-m", "hvdtrain"]:
        rest = command[options + 2:]
    elif name == "hvdtrain":  # the console script
        rest = command[1:]
    else:
        return None
    from ..arguments import HELP_WORDS, SUMMARIES, looks_like_command

    if rest and rest[0] == "train":
        return rest[1:]
    if rest and (rest[0] in SUMMARIES or rest[0] in HELP_WORDS or looks_like_command(rest[0])):
        return None
    return rest


def adasum_problem(controller: str, built: Mapping[str, bool], size: int, hosts: int, gpu: bool) -> str | None:
    """Why Horovod 0.28 cannot run ``dist.op=adasum`` in this job, or None: its Adasum runs on the
    MPI controller alone (operations.cc builds no Adasum for Gloo), over a power-of-2 number of
    ranks on CPU, of hosts with NCCL on GPU (torch/mpi_ops.py)."""
    fix = "or set dist.op=average"
    if not built.get("mpi"):
        return ("dist.op=adasum needs Horovod built with MPI (Horovod's Adasum runs on MPI alone), and this one "
                f"has no MPI: install Open MPI and rebuild Horovod (make setup), {fix}")
    if controller != "mpi":
        return (f"dist.op=adasum needs Horovod's MPI controller (Horovod's Adasum runs on MPI alone), and this job "
                f"runs on {controller}: launch with horovodrun --mpi (hvdtrain launch --mpi) or mpirun, {fix}")
    nccl = gpu and built.get("nccl", False)
    count, what = (hosts, "hosts") if nccl else (size, "ranks")
    if count & (count - 1):
        return (f"dist.op=adasum needs a power-of-2 number of {what} (Horovod's Adasum{' with NCCL' if nccl else ''}), "
                f"and this job has {count}: run on {1 << (count.bit_length() - 1)} or {1 << count.bit_length()}, {fix}")
    return None

