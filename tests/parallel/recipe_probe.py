"""Train under a launcher and save what each rank ended with, for tests/parallel/test_recipes.py.

Usage: recipe_probe.py OUT_DIR train [--config FILE] [key=value ...]
           one run; OUT_DIR/rank<r>.pt: parameters and buffers, EMA weights, optimizer state, metrics
       recipe_probe.py OUT_DIR presets DATA_DIR NAME... -- [key=value ...]
           every named preset, shrunk to tiny images and 2 steps, one after the other in this process
           (one launch for all: starting ranks costs more than the steps); OUT_DIR/presets<r>.json:
           per preset, a digest of the parameters and of the EMA weights, the steps run and the
           validation metrics. Then, after "--", one more run saved as in "train".
"""

import hashlib
import json
import sys
from pathlib import Path

import torch

from hvdtrain.api import run_training
from hvdtrain.cli import train_parser
from hvdtrain.comm import dist
from hvdtrain.job_config import load_config
from hvdtrain.model.build import unwrap_state_dict


def digest(state: dict) -> str:
    """A hash of every tensor's bytes: equal digests mean bitwise-equal tensors."""
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tiny(name: str, data_dir: str, out: Path) -> list[str]:
    """Overrides that shrink a preset to 2 steps of 4 tiny images per rank on the CPU, keeping its
    optimizer, schedule, EMA, augmentation and resolution features."""
    cfg = load_config(name)
    overrides = [f"data.dir={data_dir}", "data.image_size=32", "data.workers=0", "data.val_resize=0",
                 "train.batch_size=4", "train.steps_per_epoch=2", "train.epochs=1", "runtime.threads=1",
                 "amp.enabled=false", "checkpoint.resume=never", "output.progress=false",
                 "output.tensorboard=false", "runtime.stats_interval=0", "dist.timeout_seconds=300",
                 f"output.dir={out / name}"]
    if cfg.data.max_res:
        overrides += ["data.min_res=32", "data.max_res=64"]
    if cfg.data.val_image_size:
        overrides += ["data.val_image_size=48"]
    return overrides


def save_run(run, metrics, path: Path) -> None:
    ema = getattr(run, "ema", None)
    torch.save({
        "state": unwrap_state_dict(run.state.model),
        "ema": ema.state_dict()["module"] if ema is not None else None,
        "optimizer": run.state.optimizer.state_dict(),
        "metrics": metrics, "step": run.state.position.step, "rank": dist.rank(), "size": dist.size(),
    }, path)


def main() -> None:
    out, mode, rest = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    if mode == "presets":
        split = rest.index("--")
        data_dir, names, rest = rest[0], rest[1:split], rest[split + 1:]
        results = {}
        for name in names:
            run, metrics = run_training(load_config(name, tiny(name, data_dir, out)))
            ema = getattr(run, "ema", None)
            results[name] = {"params": digest(unwrap_state_dict(run.state.model)),
                             "ema": digest(ema.state_dict()["module"]) if ema is not None else None,
                             "steps": run.state.position.step, "optimizer": type(run.state.optimizer).__name__,
                             # the validation metrics, without the rank's own timings
                             "val": {k: v for k, v in metrics["val"].items() if isinstance(v, (int, float))
                                     and k not in ("seconds", "samples_per_sec")}}
        (out / f"presets{dist.rank()}.json").write_text(json.dumps(results))
    args = train_parser().parse_args(rest)
    run, metrics = run_training(load_config(args.config, args.overrides))
    save_run(run, metrics, out / f"rank{dist.rank()}.pt")


# tests/shared_ranks: this script may run on the shared ranks
if __name__ == "__main__":  # loader workers (forkserver) import this file: train only when run
    main()
