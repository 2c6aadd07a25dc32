"""Training from tar shards with really launched ranks: 2 ranks under horovodrun and mpirun end with
identical parameters, a mid-epoch resume ends bitwise where the uninterrupted run ended, and the
same shards served by a local S3-compatible server (moto in server mode, on loopback) train to the
same parameters as the local copy. Object-storage failures are one line each."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import PROBE, launch

S3_PORT = 25131
DEAD_PORT = 25199  # nothing listens there


@pytest.fixture(scope="module")
def shard_dir(tiny_data, tmp_path_factory) -> Path:
    from hvdtrain.tools.prepare import prepare

    dst = tmp_path_factory.mktemp("tiny_shards") / "shards"
    prepare(tiny_data, dst, shard_size_mb=0.03, progress=False)
    return dst


@pytest.fixture
def s3(shard_dir, monkeypatch):
    """A moto S3 server on 127.0.0.1 holding the shards under s3://hvdtrain-test/tiny; the standard
    AWS variables point this process and the launched ranks (they inherit os.environ) at it."""
    pytest.importorskip("moto")
    s3fs = pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=S3_PORT, verbose=False)
    server.start()
    try:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{S3_PORT}",
                           "AWS_EC2_METADATA_DISABLED": "true", "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
                           "AWS_CONFIG_FILE": "/nonexistent"}.items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        fs = s3fs.S3FileSystem()
        try:
            fs.mkdir("s3://hvdtrain-test")
        except FileExistsError:  # moto keeps its buckets in this process across server restarts
            pass
        for path in sorted(shard_dir.iterdir()):
            fs.put(str(path), f"s3://hvdtrain-test/tiny/{path.name}")
        yield "s3://hvdtrain-test/tiny"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


def args(data: str, run_dir: Path, *extra: str) -> list[str]:
    # 96 training images, 2 ranks x 8: 6 steps per epoch; 21 validation images.
    return ["--config", "debug", f"data.dir={data}", f"output.dir={run_dir}", "train.steps_per_epoch=0",
            "checkpoint.every_steps=3", "checkpoint.keep=10", "data.shuffle_buffer=16", *extra]


def ranks_of(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_two_ranks_from_shards_local_s3_resumed_and_under_mpirun(shard_dir, s3, tmp_path):
    workers = ["data.workers=2"]  # the worker dealing and the resume's worker rotation are exercised
    local = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "a")]
                   + args(str(shard_dir), tmp_path / "run_a", *workers), tmp_path)
    assert "shards of" in local.stdout and "one file opened per shard" in local.stdout
    ranks = ranks_of(tmp_path / "a")
    assert_same(ranks[0]["state"], ranks[1]["state"])
    assert ranks[0]["step"] == 12
    records = metrics(tmp_path / "run_a")
    assert [r["samples"] for r in records if r["split"] == "val"] == [21, 21]   # every image once
    assert [r["samples"] for r in records if r["split"] == "train"] == [96, 96]
    expected = ranks[0]["state"]

    # The same shards from the S3 server: the same parameters.
    remote = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "b")]
                    + args(s3, tmp_path / "run_b", *workers), tmp_path)
    assert f"shards of {s3}" in remote.stdout
    assert_same(ranks_of(tmp_path / "b")[0]["state"], expected)

    # Resumed after 3 of 6 steps of the first epoch: bitwise the uninterrupted result.
    checkpoint = tmp_path / "run_a" / "checkpoints" / "step-00000003.pt"
    resumed = launch("horovodrun-gloo", 2, [str(PROBE), str(tmp_path / "c")]
                     + args(str(shard_dir), tmp_path / "run_c", *workers, f"checkpoint.resume={checkpoint}"),
                     tmp_path)
    assert "at epoch 1, step 3/6" in resumed.stdout
    assert_same(ranks_of(tmp_path / "c")[0]["state"], expected)

    # mpirun (MPI controller), same data and settings: the same parameters again.
    launch("mpirun", 2, [str(PROBE), str(tmp_path / "d")] + args(str(shard_dir), tmp_path / "run_d", *workers),
           tmp_path)
    mpi = ranks_of(tmp_path / "d")
    assert mpi[0]["controller"] == "mpi"
    assert_same(mpi[0]["state"], mpi[1]["state"])
    assert_same(mpi[0]["state"], expected)


def test_object_storage_failures_are_one_line_each(s3, monkeypatch):
    import s3fs

    from hvdtrain.data import DataError
    from hvdtrain.data.shards.manifest import read_manifest

    assert read_manifest(s3).train.size == 96
    cases = [
        ("s3://no-such-bucket/tiny", {}, "bucket 'no-such-bucket' does not exist"),
        (s3 + "-missing", {}, "no manifest.json under data.dir="),
        (s3, {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None}, "no usable credentials"),
        (s3, {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{DEAD_PORT}"}, "cannot reach the object store"),
    ]
    for url, env, message in cases:
        with monkeypatch.context() as patch:
            for key, value in env.items():
                if value is None:
                    patch.delenv(key, raising=False)
                else:
                    patch.setenv(key, value)
            s3fs.S3FileSystem.clear_instance_cache()
            with pytest.raises(DataError) as caught:
                read_manifest(url)
        text = str(caught.value)
        assert message in text and "\n" not in text, text
    assert os.environ["AWS_ENDPOINT_URL"].endswith(str(S3_PORT))
