"""Values and files that used to end in a traceback, a hang or a silent waste are
refused in one line: non-finite numbers, sizes no real run uses, oversized or deeply nested config
files, images over the pixel limit (both decoders), host names that ssh would read as options."""

from __future__ import annotations

import io
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hvdtrain.config import MAX_CONFIG_BYTES, UPPER_BOUNDS, ConfigError, DataConfig
from hvdtrain.data.image.crops import CenterCrop, TrainCrop
from hvdtrain.data.image.decode import DEFAULT_MAX_PIXELS, BadImage
from hvdtrain.data.image.folder import BadFileError, CountingLoader, ImageFiles, collate
from hvdtrain.data.image.transforms import fast_eval_transform, fast_train_transform
from hvdtrain.job_config import load_config
from hvdtrain.tools.doctor import DoctorError, parse_hosts, read_hostfile, ssh_command

REPO = Path(__file__).resolve().parents[2]


def refused(config_file: str | None = None, overrides: list[str] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(config_file, list(overrides))
    message = str(info.value)
    assert "\n" not in message
    return message


# --- non-finite numbers -------------------------------------------------------------------------

@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
def test_non_finite_numbers_are_refused_on_the_command_line(text):
    expected = f"config key 'optim.base_lr' must be a finite number, got '{text}'"
    assert refused(None, [f"optim.base_lr={text}"]) == expected


@pytest.mark.parametrize("text", [".nan", ".inf", "-.inf", ".NaN"])
def test_non_finite_numbers_are_refused_in_yaml_for_every_float_key(tmp_path, text):
    # dist.bucket_mb takes -1 and optim.label_smoothing is checked against 1: nan passes both
    # comparisons, and inf would pass the first; every float key is refused where it is set.
    for section, key in (("optim", "base_lr"), ("dist", "bucket_mb"), ("runtime", "stats_interval"),
                         ("augment", "hflip"), ("ema", "decay")):
        path = tmp_path / "cfg.yaml"
        path.write_text(f"{section}:\n  {key}: {text}\n")
        assert refused(str(path)).startswith(f"config key '{section}.{key}' must be a finite number")


def test_finite_floats_still_load():
    cfg = load_config(None, ["optim.base_lr=1e-3", "dist.bucket_mb=-1", "optim.weight_decay=0"])
    assert (cfg.optim.base_lr, cfg.dist.bucket_mb, cfg.optim.weight_decay) == (1e-3, -1.0, 0.0)


# --- sizes ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("data.workers=100000", "config key 'data.workers' must be at most 256 (loader processes per rank), got 100000"),
    ("data.image_size=100000", "config key 'data.image_size' must be at most 4096 (pixels a side), got 100000"),
    ("runtime.threads=1000000", "config key 'runtime.threads' must be at most 1024 (torch threads per rank), "
                                "got 1000000"),
    ("data.prefetch_factor=100000", "config key 'data.prefetch_factor' must be at most 64"),
    ("model.num_classes=1000000000", "config key 'model.num_classes' must be at most 1000000"),
    ("data.val_image_size=5000", "config key 'data.val_image_size' must be at most 4096"),
    ("train.batch_size=10000000", "config key 'train.batch_size' must be at most 1048576"),
])
def test_sizes_that_allocate_or_start_processes_are_bounded(override, message):
    assert refused(None, [override]).startswith(message)


def test_the_bounds_leave_real_runs_alone():
    # ImageNet-21k (21,841 classes), a 4096 batch on one rank, 64 workers, a 2048 px crop.
    cfg = load_config(None, ["model.num_classes=21841", "train.batch_size=4096", "data.workers=64",
                             "data.image_size=2048", "runtime.threads=256", "data.synthetic_samples=14197122"])
    assert cfg.data.workers == 64
    at_the_bounds = load_config(None, [f"{key}={bound}" for key, (bound, _) in UPPER_BOUNDS.items()])
    assert at_the_bounds.runtime.threads == 1024


def test_a_huge_key_is_refused_quickly_and_shortly(tmp_path):
    # difflib compared a 500 KB key with every valid key for 26 s; the message quoted it whole.
    path = tmp_path / "cfg.yaml"
    path.write_text(f"? train.{'x' * 200_000}\n: 3\n")
    message = refused(str(path))
    assert message.startswith("unknown config key 'train.xxx") and "..." in message and len(message) < 400


# --- config files -----------------------------------------------------------------------------------

def test_a_large_config_file_is_refused_before_parsing(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("seed: 1\n" + "# padding\n" * (MAX_CONFIG_BYTES // 10 + 1))
    assert refused(str(path)) == (f"config file '{path}' is larger than 256 KB: a config holds a few KB of keys "
                                  "(is it the right file?)")


@pytest.mark.parametrize("levels", [21, 50_000])
def test_a_deeply_nested_config_file_is_refused_without_recursion(tmp_path, levels):
    # The top-level mapping is one level: a sequence nested levels - 1 deep inside it.
    path = tmp_path / "deep.yaml"
    path.write_text("seed: " + "[" * (levels - 1) + "1" + "]" * (levels - 1) + "\n")
    assert refused(str(path)) == (f"config file '{path}' nests more than 20 levels deep: a config has sections "
                                  "of keys (e.g. train: {epochs: 90}), at most 3 levels")


def test_nesting_up_to_the_limit_reaches_the_key_checks(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("seed: " + "[" * 19 + "1" + "]" * 19 + "\n")
    assert refused(str(path)).startswith("config key 'seed' expects int, got [[[")


def test_an_integer_of_thousands_of_digits_is_invalid_yaml(tmp_path):
    path = tmp_path / "digits.yaml"
    path.write_text("seed: " + "9" * 5000 + "\n")
    assert refused(str(path)).startswith(f"config file '{path}' is not valid YAML: Exceeds the limit (4300 digits)")


# --- image pixel limit -------------------------------------------------------------------------------

def encoded(fmt: str, width: int, height: int, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(width * height)
    image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, fmt)
    return buffer.getvalue()


# JPEG goes through libjpeg-turbo (simplejpeg), PNG and CMYK JPEG through Pillow.
KINDS = {"jpeg": ("JPEG", "RGB"), "png": ("PNG", "RGB"), "cmyk_jpeg": ("JPEG", "CMYK")}


@pytest.mark.parametrize("kind", KINDS)
def test_both_decoders_refuse_images_over_the_pixel_limit(kind):
    fmt, mode = KINDS[kind]
    data = encoded(fmt, 64, 48, mode)  # 3072 pixels
    for limit, accepted in ((3071, False), (3072, True), (0, True)):
        for transform in (TrainCrop(16, max_pixels=limit), CenterCrop(16, 18, max_pixels=limit)):
            if accepted:
                assert transform(data).shape == (3, 16, 16)
            else:
                with pytest.raises(BadImage, match=r"data\.max_image_pixels=3071"):
                    transform(data)
    # Pillow's default limit, the one its own decoder applies outside hvdtrain (and still does here).
    assert TrainCrop(16).max_pixels == DEFAULT_MAX_PIXELS == DataConfig().max_image_pixels == 89_478_485
    assert Image.MAX_IMAGE_PIXELS == 89_478_485


def test_the_pixel_limit_comes_from_the_config_and_a_big_file_is_a_bad_file(tmp_path, capsys):
    folder = tmp_path / "train" / "c0"
    folder.mkdir(parents=True)
    names = ["a.JPEG", "b_big.JPEG", "c.png", "d_big.png", "e.JPEG"]
    for name in names:
        side = 40 if "big" in name else 20
        (folder / name).write_bytes(encoded("PNG" if name.endswith("png") else "JPEG", side, side))
    data = DataConfig(image_size=16, val_resize=18, max_image_pixels=1000)  # 20x20 = 400 in, 40x40 = 1600 out
    for transform in (fast_train_transform(data), fast_eval_transform(data)):
        dataset = ImageFiles(tmp_path / "train", [f"c0/{n}" for n in names], [0, 1, 2, 3, 4], transform,
                             replace_bad=True)
        loader = CountingLoader(torch.utils.data.DataLoader(dataset, batch_size=5, collate_fn=collate), fail=False)
        images, labels = next(iter(loader))
        # skip: each big file is counted and replaced by the next one in index order
        assert images.shape == (5, 3, 16, 16) and labels.tolist() == [0, 2, 2, 4, 4]
        assert loader.pop_bad_files() == 2
        strict = CountingLoader(torch.utils.data.DataLoader(dataset, batch_size=5, collate_fn=collate), fail=True)
        with pytest.raises(BadFileError) as info:
            list(strict)
        assert "b_big.JPEG (40x40 = 1600 pixels exceeds data.max_image_pixels=1000)" in str(info.value)
        assert "\n" not in str(info.value)
    assert "d_big.png" in capsys.readouterr().err
    refused(None, ["data.max_image_pixels=-1"])


# --- host names ---------------------------------------------------------------------------------------

def test_the_doctor_refuses_host_names_that_ssh_would_read_as_options(tmp_path):
    with pytest.raises(DoctorError, match=r"^-H: host name '-oProxyCommand=touch /tmp/x' starts with '-'"):
        parse_hosts("node0:1,-oProxyCommand=touch /tmp/x:1")
    with pytest.raises(DoctorError, match=r"host name 'a;b' holds ';'"):
        parse_hosts("a;b:2")
    path = tmp_path / "hosts"
    path.write_text("node0 slots=2\n-oProxyCommand=x slots=2\n")
    with pytest.raises(DoctorError, match=rf"^{path}:2: host name '-oProxyCommand=x' starts with '-'"):
        read_hostfile(path)
    path.write_text("node-0.cluster slots=2\nuser@10.0.0.2 slots=2\nnode_3\n")
    assert [h.name for h in read_hostfile(path)] == ["node-0.cluster", "user@10.0.0.2", "node_3"]
    cmd = ssh_command("node0", "true", 2222, None, 5)
    assert cmd[-3:] == ["--", "node0", "true"]


def test_discover_hosts_skips_names_that_are_not_host_names(tmp_path):
    # A stand-in ssh that records its arguments and answers for every host.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ssh").write_text(f'#!/bin/sh\necho "$@" >>{tmp_path}/ssh.log\n')
    (bin_dir / "ssh").chmod(0o755)
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("node0 slots=2\n-oProxyCommand=touch${IFS}/tmp/pwned:4\nnode1:4\na;b\n")
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", HVDTRAIN_HOSTS_FILE=str(hosts))
    result = subprocess.run(["bash", str(REPO / "hostfiles" / "discover-hosts.sh")], env=env, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["node0:2", "node1:4"]
    assert result.stderr.splitlines() == [
        f"discover-hosts.sh: skipping '{name}' in {hosts}: not a host name (letters, digits, '.', '-', '_', "
        "not starting with '-')" for name in ("-oProxyCommand=touch${IFS}/tmp/pwned", "a;b")]
    calls = (tmp_path / "ssh.log").read_text().splitlines()
    assert calls == ["-o BatchMode=yes -o ConnectTimeout=2 -- node0 true",
                     "-o BatchMode=yes -o ConnectTimeout=2 -- node1 true"]


# --- keys that size a loop or an allocation --------------------------------------------------------

@pytest.mark.parametrize("override, message", [
    ("data.synthetic_samples=4000000000", "config key 'data.synthetic_samples' must be at most 1073741824"),
    ("data.shuffle_buffer=100000000", "config key 'data.shuffle_buffer' must be at most 1048576"),
    ("train.backward_passes_per_step=100000", "config key 'train.backward_passes_per_step' must be at most 1024"),
    ("train.epochs=10000000", "config key 'train.epochs' must be at most 100000"),
    ("dist.bucket_mb=1000000", "config key 'dist.bucket_mb' must be at most 16384"),
    ("data.max_image_pixels=100000000000", "config key 'data.max_image_pixels' must be at most 1073741824"),
])
def test_keys_that_size_a_loop_or_an_allocation_are_bounded(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert str(error.value).startswith(message)


def test_recommendation_layer_widths_are_bounded():
    with pytest.raises(ConfigError, match="at most 65536"):
        load_config("movielens", ["recommendation.mlp_layers=100000000,16"])
    assert load_config("movielens", ["recommendation.mlp_layers=1024,256"]).recommendation.mlp_layers == "1024,256"
