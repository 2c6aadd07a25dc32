"""A really launched 2-rank job over a dataset with CMYK, grayscale, PNG-named-JPEG and broken
files: both ranks take the same steps, every decodable image is used, bad files are counted."""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from PIL import Image

from hvdtrain.data.demo import generate
from tests.helpers import PROBE, launch


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, quality=90) if fmt == "JPEG" else image.save(buffer, fmt)
    return buffer.getvalue()


def messy_dataset(root: Path) -> None:
    """train: 24 generated + 4 odd-but-decodable + 4 undecodable = 32 files; val: 12 + 2 bad.

    Each undecodable file sorts last in its class folder, so the file that replaces it (the next
    in index order) is a good one and each bad file is met exactly once per epoch.
    """
    generate(root, train_per_class=6, val_per_class=3, size=40, num_classes=4)
    classes = sorted(p.name for p in (root / "train").iterdir())
    sample = Image.open(next((root / "train" / classes[0]).iterdir())).convert("RGB")
    good = {"cmyk.JPEG": encoded(sample.convert("CMYK"), "JPEG"), "gray.JPEG": encoded(sample.convert("L"), "JPEG"),
            "png.JPEG": encoded(sample, "PNG"), "rgba.png": encoded(sample.convert("RGBA"), "PNG")}
    for name, cls in zip(good, classes):
        (root / "train" / cls / f"a_{name}").write_bytes(good[name])
    jpeg = encoded(sample, "JPEG")
    bad = {"truncated.JPEG": jpeg[: len(jpeg) // 2], "empty.JPEG": b"", "text.JPEG": b"404 not found\n",
           "garbage.png": b"\x89PNG\r\n\x1a\n" + bytes(64)}
    for name, cls in zip(bad, classes):
        (root / "train" / cls / f"zz_{name}").write_bytes(bad[name])
    (root / "val" / classes[1] / "zz_truncated.JPEG").write_bytes(jpeg[: len(jpeg) // 3])
    (root / "val" / classes[3] / "zz_empty.JPEG").write_bytes(b"")


def test_two_ranks_skip_bad_files_in_step(tmp_path):
    data = tmp_path / "data"
    messy_dataset(data)
    run_dir = tmp_path / "run"
    result = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "probe"), "--config", "debug",
                                           f"data.dir={data}", f"output.dir={run_dir}", "train.steps_per_epoch=0",
                                           # 4 bad files of 32 (12.5%): past the default limit of 1%
                                           "data.max_bad_fraction=0.2", "output.tensorboard=false"], tmp_path)
    ranks = [torch.load(tmp_path / "probe" / f"rank{r}.pt", weights_only=False) for r in range(2)]
    # 32 files / (2 ranks x 8) = 2 steps per epoch on both ranks, 2 epochs.
    assert ranks[0]["step"] == ranks[1]["step"] == 4
    for key, value in ranks[0]["state"].items():
        assert torch.equal(value, ranks[1]["state"][key]), key

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    val = [r for r in records if r["split"] == "val"]
    assert [r["bad_files"] for r in train] == [4, 4]
    assert [r["samples"] for r in train] == [32, 32]
    assert [r["bad_files"] for r in val] == [2, 2]
    assert [r["samples"] for r in val] == [12, 12]   # every decodable val image once, bad ones dropped
    summary = [line for line in result.stdout.splitlines() if "epoch 2/2" in line]
    assert summary and "bad files skipped: 4 train / 2 val" in summary[0]
    assert f"skipping undecodable image file {data}/train/" in result.stderr + result.stdout
    # Each rank names its first three; bad_files.jsonl lists every one, per epoch and split.
    listed = [json.loads(line) for line in (run_dir / "bad_files.jsonl").read_text().splitlines()]
    for epoch in (0, 1):
        train_names = sorted(Path(e["path"]).name for e in listed if e["epoch"] == epoch and e["split"] == "train")
        assert train_names == ["zz_empty.JPEG", "zz_garbage.png", "zz_text.JPEG", "zz_truncated.JPEG"]
        assert sorted(Path(e["path"]).name for e in listed if e["epoch"] == epoch and e["split"] == "val") == \
            ["zz_empty.JPEG", "zz_truncated.JPEG"]
    assert {e["reason"] for e in listed} == {"undecodable"}


def test_on_bad_file_fail_stops_naming_the_file(tmp_path):
    data = tmp_path / "data"
    messy_dataset(data)
    result = launch("single", 1, ["-m", "hvdtrain", "--config", "debug", f"data.dir={data}",
                                  f"output.dir={tmp_path / 'run'}", "data.on_bad_file=fail", "train.steps_per_epoch=0"],
                    tmp_path, check=False)
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(errors) == 1, result.stderr
    assert errors[0].startswith("hvdtrain: error: undecodable image file ")
    assert "zz_" in errors[0] and "data.on_bad_file=fail" in errors[0]
