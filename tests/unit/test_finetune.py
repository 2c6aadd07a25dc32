"""Fine-tuning and small-image pieces in one process: the augment section's crops, the seeded
validation split of data.val_fraction, model.freeze, optim.head_lr_mult, model.weights from every
kind of source (torchvision names through a hand-filled hub cache, files of each format, timm),
and the one-line errors."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import models

from hvdtrain.config import AugmentConfig, ConfigError, DataConfig, ModelConfig, OptimConfig
from hvdtrain.data.demo import generate
from hvdtrain.data.files.index import DataError
from hvdtrain.data.image.crops import CenterCrop, FlipOnly, PadCrop, TrainCrop
from hvdtrain.data.image.transforms import fast_train_transform
from hvdtrain.job_config import load_config
from hvdtrain.model.build import classifier_name
from hvdtrain.model.finetune import (
    WeightsError,
    apply_freeze,
    fetch_torchvision_weights,
    fit_weights,
    load_weights,
    read_weights_file,
    torchvision_weights_file,
)
from hvdtrain.optim.build import build_sgd, set_lr
from hvdtrain.tasks.image_classification import file_datasets


def jpeg(width: int, height: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


def seeded(transform, data: bytes, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return transform(data)


# --- the augment section --------------------------------------------------------------------------

def test_augment_crops_and_flips():
    data = jpeg(32, 32)
    base = CenterCrop(32, 32)(data)
    # random_pad: a window of the zero-padded image, drawn top, left, flip from the sample's seed.
    crop = PadCrop(32, 32, pad=3, hflip=0.0)
    padded = torch.nn.functional.pad(base, (3, 3, 3, 3))
    for seed in range(20):
        torch.manual_seed(seed)
        top, left = int(torch.randint(0, 7, (1,))), int(torch.randint(0, 7, (1,)))
        out = seeded(crop, data, seed)
        assert torch.equal(out, padded[:, top:top + 32, left:left + 32])
        assert torch.equal(out, seeded(crop, data, seed))          # per-sample seeded: reproducible
    assert torch.equal(seeded(PadCrop(32, 32, pad=0), data, 1), base)
    # hflip: the same crop draws, the flip decided by the probability (0 never, 1 always).
    big = jpeg(90, 70, seed=1)
    for seed in range(10):
        never = seeded(TrainCrop(32, hflip=0.0), big, seed)
        always = seeded(TrainCrop(32, hflip=1.0), big, seed)
        assert torch.equal(always, never.flip(-1))
    # scale/ratio: (1, 1) and (1, 1) on a square image is the whole image, resized.
    whole = seeded(TrainCrop(32, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0), jpeg(64, 64), 0)
    assert torch.equal(whole, seeded(TrainCrop(32, scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=0.0), jpeg(64, 64), 5))
    # Dispatch from the config; data.augment=false still means the validation crop.
    data_cfg = DataConfig(image_size=32, val_resize=32)
    assert isinstance(fast_train_transform(data_cfg, AugmentConfig(crop="random_pad")), PadCrop)
    assert isinstance(fast_train_transform(data_cfg, AugmentConfig(crop="center", hflip=0.5)), FlipOnly)
    assert isinstance(fast_train_transform(data_cfg, AugmentConfig(crop="center", hflip=0.0)), CenterCrop)
    resized = fast_train_transform(data_cfg, AugmentConfig(scale="0.5,1", ratio="3/4,4/3", hflip=0.25))
    assert (resized.scale, resized.ratio, resized.hflip) == ((0.5, 1.0), (0.75, 4 / 3), 0.25)
    assert isinstance(fast_train_transform(DataConfig(augment=False), AugmentConfig(crop="random_pad")), CenterCrop)


@pytest.mark.parametrize("override, message", [
    ("augment.scale=0.5", "config key 'augment.scale': expected MIN,MAX (e.g. 0.08,1.0), got '0.5'"),
    ("augment.ratio=2,1", "config key 'augment.ratio': expected 0 < MIN <= MAX, got '2,1'"),
    ("augment.hflip=1.5", "config key 'augment.hflip' is a probability (0 to 1), got 1.5"),
    ("augment.crop=random", "config key 'augment.crop' expects one of random_resized, random_pad, center"),
    ("data.val_fraction=1", "config key 'data.val_fraction' must be in [0, 1), got 1.0"),
    ("optim.head_lr_mult=0", "config key 'optim.head_lr_mult' must be positive, got 0.0"),
])
def test_bad_keys_stop_with_one_line(override, message):
    with pytest.raises(ConfigError) as error:
        load_config("small_images", [override])
    assert str(error.value).startswith(message) and "\n" not in str(error.value)


# --- data.val_fraction ----------------------------------------------------------------------------

def test_val_fraction_splits_train_per_class_and_is_recorded(tmp_path):
    root = tmp_path / "data"
    generate(root, train_per_class=10, val_per_class=0, size=16, num_classes=3)
    shutil.rmtree(root / "val")
    data = DataConfig(image_size=16, val_resize=16, index_cache=False, val_fraction=0.2)
    with pytest.raises(DataError, match="or set data.val_fraction=0.1"):
        file_datasets(DataConfig(index_cache=False), root)
    run = tmp_path / "run"
    _, _, unrecorded = file_datasets(data, root, run_dir=run, seed=3)  # evaluation: no run folder is made
    assert not run.exists() and "not recorded" in unrecorded.note
    run.mkdir()  # training makes the run folder before it builds the loaders
    train, val, index = file_datasets(data, root, run_dir=run, seed=3)
    assert (len(train), len(val)) == (24, 6)
    assert sorted(index.val.labels) == [0, 0, 1, 1, 2, 2]          # stratified: 2 of 10 per class
    assert not set(index.val.paths) & set(index.train.paths)
    assert val.split_dir == str(root / "train") and val[0][0].shape == (3, 16, 16)
    recorded = json.loads((run / "val_split.json").read_text())
    assert recorded["val"] == index.val.paths and "recorded in" in index.note
    # Another seed chooses another split, but this run keeps its recorded one.
    (tmp_path / "other").mkdir()
    _, _, other = file_datasets(data, root, run_dir=tmp_path / "other", seed=4)
    assert other.val.paths != index.val.paths
    _, _, again = file_datasets(data, root, run_dir=run, seed=4)
    assert again.val.paths == index.val.paths and "as recorded in" in again.note
    with pytest.raises(DataError, match=r"data.val_fraction=0.3, but this run's split .* holds 0.2"):
        file_datasets(DataConfig(index_cache=False, val_fraction=0.3), root, run_dir=run)
    (root / "train" / index.val.paths[0]).unlink()
    with pytest.raises(DataError, match="1 validation files of the recorded split are no longer in train/"):
        file_datasets(data, root, run_dir=run)


# --- model.freeze and optim.head_lr_mult -------------------------------------------------------------

def test_freeze_backbone_keeps_frozen_batchnorm_in_eval_and_head_lr_mult():
    torch.manual_seed(0)
    model = models.resnet18(num_classes=5)
    line = apply_freeze(model, "backbone", "resnet18")
    trained = [name for name, p in model.named_parameters() if p.requires_grad]
    assert trained == ["fc.weight", "fc.bias"] and "60 of 62 parameter tensors frozen" in line
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    model(torch.randn(4, 3, 32, 32))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats untouched
    assert not model.bn1.training and model.training
    # Order matters: freeze layer1, then thaw its first block.
    model = models.resnet18(num_classes=5)
    apply_freeze(model, "layer1,!layer1.0", "resnet18")
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(name.startswith("layer1.1.") for name in frozen)
    with pytest.raises(ConfigError) as error:
        apply_freeze(models.resnet18(), "backbone,layer9", "resnet18")
    assert str(error.value).startswith("config key 'model.freeze': pattern 'layer9' matches no parameter of "
                                       "resnet18 (module names look like conv1, ")
    # head_lr_mult: the head's two groups get the multiple; weight decay still spares 1-d parameters.
    model = models.resnet18(num_classes=5)
    apply_freeze(model, "layer1", "resnet18")
    optimizer = build_sgd(model, OptimConfig(head_lr_mult=10.0, weight_decay=1e-4), lr=0.1)
    set_lr(optimizer, 0.02)
    groups = [(len(g["params"]), g["weight_decay"], g["lr"]) for g in optimizer.param_groups]
    head_weight, head_bias = model.fc.weight, model.fc.bias
    assert [g["params"] for g in optimizer.param_groups[2:]] == [[head_weight], [head_bias]]
    assert groups[2:] == [(1, 1e-4, pytest.approx(0.2)), (1, 0.0, pytest.approx(0.2))]
    assert groups[0][2] == groups[1][2] == 0.02 and groups[1][1] == 0.0
    assert sum(n for n, _, _ in groups) == sum(p.requires_grad for p in model.parameters())
    assert classifier_name(models.mobilenet_v3_small()) == "classifier.3"
    assert classifier_name(models.squeezenet1_0()) == "classifier.1"


# --- model.weights --------------------------------------------------------------------------------

def test_weights_from_files_fit_and_replace_the_head(tmp_path):
    torch.manual_seed(0)
    source = models.resnet18(num_classes=4)
    source_state = source.state_dict()
    files = {
        "plain.pth": source_state,
        "hvdtrain.pt": {"model": source_state, "config": {}, "step": 3, "optimizer": {}, "epoch": 1},
        "timm.pth.tar": {"state_dict": {f"module.{k}": v for k, v in source_state.items()}, "epoch": 2,
                         "args": argparse.Namespace(model="resnet18")},
        "reference.pth": {"model": source_state, "optimizer": {}, "epoch": 2},
    }
    for name, payload in files.items():
        torch.save(payload, tmp_path / name)
    from safetensors.torch import save_file
    save_file(source_state, str(tmp_path / "model.safetensors"))
    for name in [*files, "model.safetensors"]:
        torch.manual_seed(1)
        target = models.resnet18(num_classes=10)
        fresh_head = target.fc.weight.detach().clone()
        line = load_weights(target, ModelConfig(arch="resnet18", weights=str(tmp_path / name)))
        assert "loaded 120 of 122 tensors, replaced fc (new, 10 outputs), missing 0, unused 0" in line, line
        assert torch.equal(target.layer4[1].conv2.weight, source.layer4[1].conv2.weight)
        assert torch.equal(target.bn1.running_var, source.bn1.running_var)
        assert torch.equal(target.fc.weight, fresh_head)            # the head stays freshly initialized
    same = models.resnet18(num_classes=4)
    assert "kept fc" in fit_weights(same, source_state, "x", "resnet18")
    assert torch.equal(same.fc.weight, source.fc.weight)
    # A file of another architecture, a missing file, a file that is no state dict: one line each.
    torch.save(models.mobilenet_v3_small().state_dict(), tmp_path / "other.pth")
    deeper = dict(source_state, **{"layer1.2.conv1.weight": torch.zeros(64, 64, 3, 3)})  # as resnet34's
    torch.save(deeper, tmp_path / "resnet34.pth")
    torch.save({"epoch": 3}, tmp_path / "nothing.pth")
    for name, message in (("other.pth", r"does not fit model.arch=resnet18: 60 tensors do not \(e.g. 'conv1.weight': "
                                        r"not in the file\); is it a checkpoint of another architecture\?"),
                          ("resnet34.pth", r"does not fit model.arch=resnet18: it has 1 tensors the model lacks "
                                           r"\(e.g. 'layer1.2.conv1.weight'\)"),
                          ("missing.pth", r"file '.*missing.pth' does not exist"),
                          ("nothing.pth", r"holds no state dict of tensors \(found: epoch\)")):
        with pytest.raises(WeightsError, match=message) as error:
            load_weights(models.resnet18(), ModelConfig(arch="resnet18", weights=str(tmp_path / name)))
        assert "\n" not in str(error.value)


def test_torchvision_weights_names_use_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    expected = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    assert torchvision_weights_file("resnet18", "IMAGENET1K_V1")[0] == expected

    def offline(url: str, target: str) -> None:  # what urllib raises on these machines
        from urllib.error import URLError
        raise URLError("[Errno -2] Name or service not known")

    with pytest.raises(WeightsError) as error:
        fetch_torchvision_weights("resnet18", "ResNet18_Weights.DEFAULT", download=offline)
    assert str(error.value) == (
        "model.weights=ResNet18_Weights.DEFAULT: cannot download resnet18-f37072fd.pth (<urlopen error [Errno -2] "
        "Name or service not known>); fetch https://download.pytorch.org/models/resnet18-f37072fd.pth on a "
        f"machine with network and place it at {expected}")
    with pytest.raises(WeightsError, match=r"'IMAGENET9K' is neither a file nor a weights name of resnet18 "
                                           r"\(IMAGENET1K_V1, DEFAULT\)"):
        torchvision_weights_file("resnet18", "IMAGENET9K")
    # Placed by hand under the expected name, the enum path loads it for real.
    torch.manual_seed(2)
    reference = models.resnet18()
    assert expected.parent.is_dir() and not expected.exists()  # the failed download left nothing behind
    torch.save(reference.state_dict(), expected)
    model = models.resnet18(num_classes=3)
    line = load_weights(model, ModelConfig(arch="resnet18", weights="IMAGENET1K_V1"))
    assert line.startswith(f"weights from torchvision IMAGENET1K_V1 ({expected}): loaded 120 of 122 tensors, "
                           f"replaced fc")
    assert torch.equal(model.layer3[0].downsample[0].weight, reference.layer3[0].downsample[0].weight)


def test_timm_models_and_their_checkpoints(tmp_path, monkeypatch):
    from hvdtrain.model.build import build_model

    torch.manual_seed(0)
    source = build_model(ModelConfig(arch="timm/test_resnet"), 7)
    torch.save({"state_dict": source.state_dict(), "arch": "test_resnet", "args": argparse.Namespace(lr=0.1)},
               tmp_path / "timm.pth.tar")
    target = build_model(ModelConfig(arch="timm/test_resnet"), 3)
    config = ModelConfig(arch="timm/test_resnet", weights=str(tmp_path / "timm.pth.tar"))
    line = load_weights(target, config)
    head = classifier_name(target)
    assert f"replaced {head} (new, 3 outputs)" in line and "missing 0, unused 0" in line
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items() if not k.startswith(head))
    with pytest.raises(WeightsError, match=r"timm weights are not downloaded by hvdtrain: fetch model.safetensors"):
        load_weights(target, ModelConfig(arch="timm/resnet18", weights="IMAGENET1K_V1"))
    with pytest.raises(ConfigError, match="unknown timm model 'resnet19x'"):
        build_model(ModelConfig(arch="timm/resnet19x"), 3)
    monkeypatch.setitem(sys.modules, "timm", None)  # as if the extra were not installed
    with pytest.raises(ConfigError) as error:
        build_model(ModelConfig(arch="timm/test_resnet"), 3)
    assert str(error.value) == ("config key 'model.arch': timm/test_resnet needs timm is not installed "
                                "(pip install -e '.[timm]', or make setup EXTRAS=timm)")
    assert read_weights_file(tmp_path / "timm.pth.tar")[1] == "checkpoint (state_dict)"
    assert Path(tmp_path / "timm.pth.tar").is_file()
