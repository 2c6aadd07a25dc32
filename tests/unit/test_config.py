import pytest
import yaml

from hvdtrain.config import Config, ConfigError, dump_yaml, from_dict
from hvdtrain.job_config import describe_keys, load_config


def write(tmp_path, text):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    return str(path)


def test_precedence_defaults_then_file_then_overrides(tmp_path):
    path = write(tmp_path, "train:\n  epochs: 7\n  batch_size: 16\noptim:\n  base_lr: 0.2\n")
    cfg = load_config(path, ["train.epochs=3"])
    assert cfg.train.epochs == 3          # override beats file
    assert cfg.train.batch_size == 16     # file beats default
    assert cfg.optim.base_lr == 0.2
    assert cfg.optim.momentum == Config().optim.momentum  # default kept


def test_file_alone_and_overrides_alone(tmp_path):
    assert load_config(write(tmp_path, "seed: 5\n")).seed == 5
    cfg = load_config(None, ["seed=9", "data.dir=/data/imagenet", "amp.enabled=true"])
    assert (cfg.seed, cfg.data.dir, cfg.amp.enabled) == (9, "/data/imagenet", True)


def test_value_types_are_coerced_from_text_and_yaml(tmp_path):
    cfg = load_config(write(tmp_path, "optim:\n  base_lr: 1e-3\n  warmup_epochs: 2\n"), ["optim.weight_decay=5e-5"])
    assert cfg.optim.base_lr == pytest.approx(1e-3)   # YAML 1.1 reads 1e-3 as a string
    assert isinstance(cfg.optim.warmup_epochs, float)
    assert cfg.optim.weight_decay == pytest.approx(5e-5)


@pytest.mark.parametrize("override, fragment", [
    ("train.epoch=3", "unknown config key 'train.epoch' (valid keys in 'train': backward_passes_per_step, batch_size"),
    ("trian.epochs=3", "unknown config key 'trian.epochs' (valid keys: amp, augment, checkpoint"),
    ("train.epochs=three", "config key 'train.epochs' expects int, got 'three'"),
    ("amp.dtype=fp8", "config key 'amp.dtype' expects one of float16, bfloat16, got 'fp8'"),
    ("model.sync_bn=maybe", "config key 'model.sync_bn' expects bool"),
    ("train.batch_size=0", "config key 'train.batch_size' must be positive"),
    ("train.epochs", "is not of the form section.key=value"),
    ("dist.stall_shutdown_seconds=30",
     "'dist.stall_shutdown_seconds' (30) must exceed dist.stall_warning_seconds (60)"),
    ("runtime.timeline_steps=20-10", "'runtime.timeline_steps': expected START-END with START < END"),
    ("runtime.timeline_steps=10-20", "'runtime.timeline_steps' needs runtime.timeline=PATH"),
    ("dist.straggler_threshold=-1", "'dist.straggler_threshold' must be >= 0"),
    ("dist.bucket_mb=-2", "'dist.bucket_mb' must be >= 0 (MB), or -1 for auto, got -2"),
    ("elastic.enabled=true dist.bucket_mb=25", "dist.bucket_mb=25 cannot be used with elastic.enabled=true"),
    ("task=recommendation model.arch=mf recommendation.sparse_embeddings=true optim.weight_decay=0 dist.bucket_mb=8",
     "dist.bucket_mb=8 cannot be used with recommendation.sparse_embeddings=true"),
    ("elastic.enabled=true runtime.cpu_affinity=rank", "runtime.cpu_affinity=rank cannot be used with elastic"),
    ("runtime.cpu_affinity=on", "config key 'runtime.cpu_affinity' expects one of auto, rank, none"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(None, override.split())
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_bad_yaml_types_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="config key 'train.epochs' expects int, got 2.5"):
        load_config(write(tmp_path, "train:\n  epochs: 2.5\n"))
    with pytest.raises(ConfigError, match="unknown config key 'data.path'"):
        load_config(write(tmp_path, "data:\n  path: /x\n"))
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "train: [1,\n"))
    with pytest.raises(ConfigError, match="config file 'missing.yaml' not found"):
        load_config("missing.yaml")


def test_shipped_configs_load_and_round_trip():
    for name in ("debug", "demo", "imagenet_resnet50"):
        cfg = load_config(name)
        assert from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg


def test_every_key_is_documented():
    rows = describe_keys()
    assert len(rows) > 30
    assert [key for key, _, _, doc in rows if not doc] == []
