"""What a shard set's own files say is checked before use: tar and pax headers parsed with progress
guaranteed and no allocation of a size a header claims, a manifest's values bounded and held to
the real files, labels inside the manifest's classes; a bad value is one line with exit code 65,
never a traceback or a hang."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from hvdtrain import outcome
from hvdtrain.config import DataConfig
from hvdtrain.data import DamagedData, DataError
from hvdtrain.data.demo import generate
from hvdtrain.data.image.transforms import fast_eval_transform
from hvdtrain.data.shards import loader as shards
from hvdtrain.data.shards.manifest import read_manifest
from hvdtrain.data.shards.tar import TarError, TarReader, pax_path
from hvdtrain.tools.prepare import prepare

REPO = Path(__file__).resolve().parents[2]


# --- tar and pax headers -------------------------------------------------------------------------------

def pax_shard(records: bytes) -> bytes:
    """A tar stream whose first member is a pax extended header holding ``records``, then one image."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data, kind in (("PaxHeaders/x", records, tarfile.XHDTYPE), ("k.jpg", b"\xff\xd8", tarfile.REGTYPE)):
            info = tarfile.TarInfo(name)
            info.size, info.type = len(data), kind
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.mark.parametrize("records", [b"0 foo=bar\n", b"5 x\n", b"99 path=far\n", b"abc path=x\n", b"-3 a=b\n",
                                     b"12 path=a\n12 path=b"], ids=["zero", "short", "past-end", "text", "negative",
                                                                    "no-newline"])
def test_a_malformed_pax_record_is_an_error_at_once(records):
    """``0 foo=bar`` used to loop for ever at 100% CPU. Run in a child with a deadline, so that the old
    code fails this test instead of hanging the suite."""
    code = (f"from hvdtrain.data.shards.tar import TarError, pax_path\n"
            f"try:\n    pax_path({records!r})\nexcept TarError as error:\n    print('TarError', error)\n")
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=20,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"pax_path({records!r}) still runs after 20 s")
    assert result.stdout.startswith("TarError malformed pax header record"), (result.stdout, result.stderr)
    with pytest.raises(TarError):
        list(TarReader(io.BytesIO(pax_shard(records))))


def record(key: str, value: str) -> bytes:
    """One pax record, its length counting itself."""
    body = f" {key}={value}\n".encode()
    length = len(body) + 1
    length += len(str(length)) - 1
    return str(length).encode() + body


def test_good_pax_records_still_name_the_member():
    assert record("path", "a/long.jpg") == b"19 path=a/long.jpg\n"
    assert pax_path(record("path", "a/long.jpg")) == "a/long.jpg"
    assert pax_path(record("mtime", "12") + record("path", "x/y.cls") + bytes(100)) == "x/y.cls"
    assert pax_path(record("path", "k" * 200)) == "k" * 200  # a three-digit length
    assert pax_path(b"") is None


def test_a_header_size_is_no_allocation(tmp_path):
    data = bytearray(pax_shard(record("path", "a/long.jpg")))
    header = data[1024:1536]  # the image's header, after the pax header and its block: claim 2**62 bytes
    header[124:136] = bytes([0x80]) + (2**62).to_bytes(11, "big")
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    data[1024:1536] = header
    (tmp_path / "big.tar").write_bytes(data)
    with open(tmp_path / "big.tar", "rb") as handle:
        with pytest.raises(TarError, match="runs past the end of the file"):
            list(TarReader(handle))
    reader = TarReader(Unseekable(bytes(data)))  # a stream of unknown size: the member bound alone
    with pytest.raises(TarError, match="more than the 1073741824 read into memory"):
        for _, is_file in reader:
            if is_file:
                reader.read()


class Unseekable(io.RawIOBase):
    def __init__(self, data: bytes):
        self.inner = io.BytesIO(data)

    def readable(self):
        return True

    def readinto(self, buffer):
        chunk = self.inner.read(len(buffer))
        buffer[:len(chunk)] = chunk
        return len(chunk)


# --- the shard manifest --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    source = tmp_path_factory.mktemp("sec_source")
    generate(source, train_per_class=4, val_per_class=2, size=16, num_classes=2)
    dst = tmp_path_factory.mktemp("sec_shards") / "shards"
    prepare(source, dst, shard_size_mb=0.005, progress=False)
    return dst


@pytest.fixture
def shard_copy(prepared, tmp_path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "shards"))


def tamper(folder: Path, change) -> None:
    manifest = json.loads((folder / "manifest.json").read_text())
    change(manifest)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def first_shard(manifest: dict) -> dict:
    return manifest["splits"]["train"]["shards"][0]


@pytest.mark.parametrize("change, message", [
    (lambda m: first_shard(m).update(images=3_000_000_000), "not a count from 0 to"),
    (lambda m: first_shard(m).update(images="lots"), "'images' is 'lots'"),
    (lambda m: first_shard(m).update(images=True), "'images' is True"),
    (lambda m: first_shard(m).update(images=10_000), "it counts 10000 images in train-000000.tar, a file of"),
    (lambda m: m.update(classes=[]), "'classes' is not a non-empty list"),
    (lambda m: m.update(classes=[f"c{i}" for i in range(1_000_001)]), "1000001 classes, more than the 1000000"),
    (lambda m: m.update(classes=[f"c{i}" for i in range(500)]), "lists 500 classes for"),
    (lambda m: first_shard(m).update(name="../outside/evil.tar"), "is not a file name inside the data folder"),
    (lambda m: first_shard(m).update(name="/etc/hostname"), "is not a file name inside the data folder"),
    (lambda m: m["splits"].pop("val"), "no list of shards for the val split"),
    (lambda m: m["splits"]["train"].update(shards={"a": 1}), "'shards' is not a list"),
], ids=["3e9", "lots", "bool", "past-size", "no-classes", "1M+1-classes", "classes>images", "dotdot", "absolute",
        "no-val", "not-a-list"])
def test_a_tampered_manifest_is_one_line_and_exit_65(shard_copy, capsys, change, message):
    tamper(shard_copy, change)
    with pytest.raises(DamagedData) as error:
        read_manifest(str(shard_copy))
    line = str(error.value)
    assert message in line and "\n" not in line and "prepare the shards again" in line
    assert outcome.report_error(error.value) == 65
    assert capsys.readouterr().err == f"hvdtrain: error: {line}\n"


def test_a_manifest_that_is_not_json_or_far_too_large_is_one_line(shard_copy):
    (shard_copy / "manifest.json").write_text("[" * 100_000)
    with pytest.raises(DamagedData, match="is not valid JSON"):
        read_manifest(str(shard_copy))
    (shard_copy / "manifest.json").write_bytes(b" " * (65 << 20))
    with pytest.raises(DamagedData, match="larger than 64 MB"):
        read_manifest(str(shard_copy))


def test_a_sparse_shard_cannot_vouch_for_a_count(shard_copy, capsys):
    """A sparse file has a size and no blocks: 64 MiB for the 1,024 bytes per record of the size check,
    (nearly) nothing on disk. The count is held to the blocks, in one line with exit code 65."""
    shard = shard_copy / "train-000000.tar"
    with open(shard, "r+b") as handle:
        handle.truncate(64 << 20)  # the real shard's records, then 64 MiB of nothing
    on_disk = shard.stat().st_blocks * 512
    assert on_disk < 1 << 20 and shard.stat().st_size == 64 << 20
    tamper(shard_copy, lambda m: first_shard(m).update(images=60_000))  # 61 MB at 1 KB a record: fits the size
    with pytest.raises(DamagedData) as error:
        read_manifest(str(shard_copy))
    line = str(error.value)
    assert f"it counts 60000 images in train-000000.tar, a file of {64 << 20} bytes with {on_disk} on disk " \
           f"(a sparse file)" in line and "\n" not in line
    assert outcome.report_error(error.value) == 65
    assert capsys.readouterr().err == f"hvdtrain: error: {line}\n"


def test_shards_anyone_can_write_are_not_trained_on(shard_copy):
    assert read_manifest(str(shard_copy)).train.size == 8
    (shard_copy / "train-000000.tar").chmod(0o666)
    with pytest.raises(DataError, match="train-000000.tar can be written by anyone"):
        read_manifest(str(shard_copy))
    (shard_copy / "train-000000.tar").chmod(0o664)  # a team's data set: its group may write
    assert read_manifest(str(shard_copy)).train.size == 8


def relabel(shard: Path, labels: dict[int, bytes]) -> None:
    """Rewrite the .cls members of ``shard`` (record number -> new label bytes)."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        record = -1
        for member, data in members:
            if member.name.endswith(".cls"):
                record += 1
                data = labels.get(record, data)
                member.size = len(data)
            tar.addfile(member, io.BytesIO(data))


def test_labels_outside_the_classes_or_not_numbers_are_bad_records(shard_copy):
    manifest = read_manifest(str(shard_copy))
    assert len(manifest.val.names) >= 2 and manifest.val.size == 4
    relabel(shard_copy / manifest.val.names[0], {0: b"7"})  # 2 classes: a head has no output 7
    relabel(shard_copy / manifest.val.names[-1], {0: b"seven"})
    stream = shards.ShardStream(manifest, "val", 0, 1, 0, 4, fast_eval_transform(DataConfig(image_size=16,
                                                                                               val_resize=18)),
                                0, 0, False)
    batches = list(stream)
    labels = torch.cat([labels for _, labels, _ in batches])
    bad = [text for _, _, names in batches for text in names]
    assert int(labels.max()) < 2 and len(labels) == 4 - 2
    assert any("label 7 outside the 2 classes of manifest.json" in str(text) for text in bad), bad
    assert any("a .cls label that is not a number" in str(text) for text in bad), bad
