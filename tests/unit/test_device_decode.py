"""data.decoder=nvimgcodec against the CPU pipeline, on nvImageCodec's CPU backend (no GPU here):
the workers plan the same crop boxes and flips from the same random draws, so every sample of
every batch is the same file with the same crop; the device's pixels are within rounding of the CPU
path's; odd files (PNG under a .JPEG name, CMYK, grayscale, truncated, empty) are handled as on the
CPU path, in training and in validation; the loader's bad-file count and names agree."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")  # as hvdtrain sets it before it imports nvImageCodec
pytest.importorskip("nvidia.nvimgcodec", reason="the gpudecode extra (nvImageCodec) is not installed")

from hvdtrain.config import ConfigError
from hvdtrain.data.image.device_decode import DeviceDecoder, EncodedBatch, Planned, plan_transforms  # noqa: E402
from hvdtrain.data.image.folder import ImageFiles, collate  # noqa: E402
from hvdtrain.data.image.transforms import fast_eval_transform, fast_train_transform  # noqa: E402
from hvdtrain.data.sampler import SeededSamples  # noqa: E402
from hvdtrain.job_config import load_config

CPU = torch.device("cpu")


def photo(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Smooth colour fields with an edge: JPEG-like content (noise would be all high frequencies)."""
    y, x = np.mgrid[0:height, 0:width]
    base = rng.uniform(0, 255, 3)
    field = np.stack([np.sin(x / rng.uniform(5, 20) + c) * np.cos(y / rng.uniform(5, 20)) for c in range(3)], -1)
    image = base + 80 * field + 40 * (x > width * rng.uniform(0.3, 0.7))[..., None]
    return np.clip(image, 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("val", 6)):
        for label in range(2):
            target = root / split / f"class{label}"
            target.mkdir(parents=True)
            for i in range(count):
                width, height = int(rng.integers(60, 140)), int(rng.integers(50, 120))
                Image.fromarray(photo(rng, width, height)).save(target / f"{i:03d}.JPEG", quality=90)
    odd = root / "train" / "class1"
    Image.fromarray(photo(rng, 90, 70)).save(odd / "png.JPEG", format="PNG")                   # PNG, .JPEG name
    Image.fromarray(photo(rng, 90, 70)).convert("CMYK").save(odd / "cmyk.JPEG", quality=90)      # CMYK JPEG
    Image.fromarray(photo(rng, 90, 70)).convert("L").save(odd / "gray.JPEG", quality=90)         # grayscale
    good = io.BytesIO()
    Image.fromarray(photo(rng, 90, 70)).save(good, format="JPEG", quality=90)
    (odd / "truncated.JPEG").write_bytes(good.getvalue()[:len(good.getvalue()) // 2])            # header, half data
    (odd / "empty.JPEG").write_bytes(b"")
    (root / "val" / "class0" / "truncated.JPEG").write_bytes(good.getvalue()[:300])
    return root


def datasets(folder: Path, split: str, transform, replace_bad: bool) -> ImageFiles:
    paths = sorted(str(p.relative_to(folder / split)) for p in (folder / split).rglob("*.JPEG"))
    labels = [int(Path(p).parts[0][-1]) for p in paths]
    return ImageFiles(folder / split, paths, labels, transform, replace_bad=replace_bad)


def both_paths(folder: Path, split: str, overrides: list[str], seed: int = 7):
    """Every sample through the CPU pipeline and through the device decoder, under the same seeds."""
    cfg = load_config("debug", ["data.image_size=32", "data.val_resize=36", *overrides])
    plan_train, plan_eval = plan_transforms(cfg.data, cfg.augment)
    training = split == "train"
    cpu = SeededSamples(datasets(folder, split, fast_train_transform(cfg.data, cfg.augment) if training
                                 else fast_eval_transform(cfg.data), replace_bad=training))
    planned = SeededSamples(datasets(folder, split, plan_train if training else plan_eval, replace_bad=training))
    keys = [(index, seed + index) for index in range(len(cpu))]
    cpu_batch = collate([cpu[key] for key in keys])
    planned_batch = collate([planned[key] for key in keys])
    encoded, labels, bad = planned_batch
    assert isinstance(encoded, EncodedBatch)
    encoded.replace_bad = training
    noted: list[str] = []
    encoded.on_bad = noted.extend
    images, positions = DeviceDecoder(CPU, cfg.data.max_image_pixels)(encoded)
    return cpu_batch, (images, labels[positions], bad + noted), encoded


@pytest.mark.parametrize("split", ["train", "val"])
def test_the_same_files_crops_and_close_pixels_as_the_cpu_pipeline(folder, split):
    (cpu_images, cpu_labels, cpu_bad), (images, labels, bad), encoded = both_paths(folder, split, [])
    assert torch.equal(labels, cpu_labels) and sorted(bad) == sorted(cpu_bad)
    assert images.shape == cpu_images.shape and images.dtype == torch.uint8
    difference = (images.int() - cpu_images.int()).abs().float()
    on_device = [slot for slot, s in enumerate(encoded.samples) if s.data is not None]
    assert len(on_device) >= len(encoded.samples) - 3  # all but the PNG, the CMYK and the padded ones
    # The CPU path decodes a crop at least twice the output size at 1/2, 1/4 or 1/8 scale (libjpeg's
    # DCT scaling) and resizes uint8; validation boxes have fractional corners, which Pillow takes
    # exactly and the device rounds to whole pixels. Close on average; at sharp edges a few pixels
    # differ more (the next test compares the same decoded pixels, and finds rounding only).
    assert difference.mean() < 2.0, (difference.mean(), difference.amax())


def test_for_the_same_crop_box_the_device_gives_the_cpu_decoders_pixels_within_rounding(folder):
    """Full-resolution libjpeg-turbo pixels, cropped and resized on the CPU, against the device's
    decode of the same box: only the resize kernel differs (uint8 against float, both antialiased
    bilinear)."""
    import simplejpeg

    from hvdtrain.data.image.crops import crop_resize

    _, (images, _, _), encoded = both_paths(folder, "train", [])
    compared = 0
    for image, sample in zip(images, encoded.samples):
        if sample.data is None:
            continue
        full = simplejpeg.decode_jpeg(sample.data, colorspace="RGB")
        reference = crop_resize(full, sample.box, 1.0, 1.0, sample.size, sample.flip)
        difference = (image.int() - reference.int()).abs()
        assert difference.float().mean() < 0.5 and difference.amax() <= 2, (sample.name, difference.amax())
        compared += 1
    assert compared >= 20


def test_bad_files_are_named_and_replaced_in_training_dropped_in_validation(folder):
    _, (images, labels, bad), encoded = both_paths(folder, "train", [])
    names = " ".join(bad)
    assert "truncated.JPEG" in names and "empty.JPEG" in names and len(bad) == 2
    assert len(images) == len(encoded.samples)  # training batches keep their size
    _, (val_images, val_labels, val_bad), val_encoded = both_paths(folder, "val", [])
    assert len(val_bad) == 1 and "truncated.JPEG" in val_bad[0]
    assert len(val_images) == len(val_labels) == 12  # 12 good images, the bad one left out


def test_a_file_that_decodes_on_no_device_is_decided_by_the_cpu_and_counted():
    """A JPEG whose header and end marker are in place and whose data does not decode (corrupt
    inside): the CPU decoders decide, and a training slot that nothing decodes takes the closest
    good image before it."""
    good = io.BytesIO()
    Image.fromarray(photo(np.random.default_rng(1), 64, 48)).save(good, format="JPEG", quality=90)
    data = good.getvalue()
    broken = data[:len(data) // 3] + b"\xff\xd9"
    samples = [Planned(16, data=data, box=(0.0, 0.0, 64.0, 48.0)), Planned(16, data=broken, box=(0.0, 0.0, 64.0, 48.0))]
    noted: list[str] = []
    batch = EncodedBatch(samples, replace_bad=True, names=["good.jpg", "broken.jpg"], on_bad=noted.extend)
    images, positions = DeviceDecoder(CPU, 0)(batch)
    assert positions == [0, 0] and torch.equal(images[0], images[1]) and len(noted) == 1 and "broken.jpg" in noted[0]
    batch = EncodedBatch(samples, replace_bad=False, names=["good.jpg", "broken.jpg"], on_bad=noted.extend)
    images, positions = DeviceDecoder(CPU, 0)(batch)
    assert positions == [0] and len(images) == 1


def test_recipes_that_change_pixels_in_the_workers_are_refused_in_one_line():
    for override in ("augment.crop=random_pad", "augment.policy=trivialaugment", "augment.random_erase=0.25"):
        cfg = load_config("debug", [override])
        with pytest.raises(ConfigError) as caught:
            plan_transforms(cfg.data, cfg.augment)
        assert "\n" not in str(caught.value) and "data.decoder=cpu" in str(caught.value)


def test_bench_data_times_both_halves_of_the_device_pipeline(tmp_path, capsys):
    from hvdtrain.data.demo import generate
    from hvdtrain.tools.bench_data import main

    generate(tmp_path / "data", train_per_class=4, val_per_class=1, size=40, num_classes=2)
    assert main([f"data.dir={tmp_path / 'data'}", "runtime.threads=1", "data.image_size=32", "train.batch_size=4",
                 "--rounds", "2", "--batches", "1", "--device-decode"]) == 0
    lines = capsys.readouterr().out.splitlines()
    # The device pipeline ran its rounds on the same 8 timed images as the CPU one, and decoded them.
    assert "images_timed[device]=8" in lines and "images_timed[hvdtrain]=8" in lines
    (report,) = [line for line in lines if line.startswith("device_decode[cpu]:")]
    assert report.endswith("images timed 8")
    rates = {line.split("=")[0]: float(line.split("=")[1]) for line in lines
             if line.startswith(("device_decode_images_per_sec", "device_plan_images_per_sec"))}
    assert len(rates) == 2 and all(rate > 0 for rate in rates.values())
    assert any(line.startswith("cores_per_1000_img_per_sec[device]=") for line in lines)


def test_auto_picks_the_cpu_pipeline_without_a_gpu_and_a_missing_library_is_one_line(monkeypatch):
    import builtins

    from hvdtrain.data.image.device_decode import choose

    assert choose("auto", CPU) == "cpu" and choose("cpu", CPU) == "cpu" and choose("nvimgcodec", CPU) == "nvimgcodec"
    real_import = builtins.__import__

    def without_nvimgcodec(name, *args, **kwargs):
        if name.startswith("nvidia.nvimgcodec"):
            raise ImportError("No module named 'nvidia.nvimgcodec'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_nvimgcodec)
    assert choose("auto", torch.device("cuda")) == "cpu"
    with pytest.raises(ConfigError) as caught:
        choose("nvimgcodec", CPU)
    assert "\n" not in str(caught.value) and "make setup EXTRAS=gpudecode" in str(caught.value)
