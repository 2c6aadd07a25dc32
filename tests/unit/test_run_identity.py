"""Which differences between a checkpoint's config and this run's refuse a resume."""

from hvdtrain.checkpoint.identity import differences, refusal
from hvdtrain.config import to_dict
from hvdtrain.job_config import load_config


def test_meaning_keys_refuse_and_the_rest_may_change():
    stored = to_dict(load_config("debug"))
    now = load_config("debug", ["optim.base_lr=0.2", "seed=3", "train.epochs=5", "data.workers=2",
                                "runtime.threads=2", "checkpoint.every_steps=10"])
    meaning, allowed = differences(stored, now)
    assert meaning == {"seed": (0, 3), "optim.base_lr": (0.4, 0.2)}
    assert set(allowed) == {"train.epochs", "data.workers", "runtime.threads", "checkpoint.every_steps"}
    line = refusal("last.pt", meaning)
    assert "\n" not in line and "seed=0 (now 3)" in line and "optim.base_lr=0.4 (now 0.2)" in line


def test_a_key_an_older_checkpoint_lacks_counts_as_its_default():
    stored = to_dict(load_config("debug"))
    del stored["optim"]["warmup_start"]
    assert differences(stored, load_config("debug")) == ({}, {})
    meaning, _ = differences(stored, load_config("debug", ["optim.warmup_start=0"]))
    assert meaning == {"optim.warmup_start": (-1.0, 0.0)}
