"""benchmarks/gpu/input_pipeline.py, the lent GPU machine's one-call benchmark of real JPEGs, at toy
size on the CPU (nvImageCodec's CPU backend, no nvidia-smi): every contender runs and the numbers
stand for work done (the epochs' steps and samples), so the script is known to work before a GPU
call is spent on it. One CPU-pipeline contender (0 workers; the decoding one has a worker): each
contender is a fresh process, the same code whatever its worker count. The measurement itself (a
GPU, its targets) is docs/benchmarks.md's, "GPU: real JPEGs, CPU against GPU decoding" (not yet run
on a GPU, so no results file)."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.helpers import BIN, REPO, job_env

pytest.importorskip("nvidia.nvimgcodec", reason="the gpudecode extra (nvImageCodec) is not installed")


@pytest.mark.slow
def test_every_contender_runs_and_counts_its_work(tmp_path):
    out = tmp_path / "out"
    result = subprocess.run([str(BIN / "python"), str(REPO / "benchmarks" / "gpu" / "input_pipeline.py"),
                             "--device", "cpu", "--arch", "resnet18", "--image-size", "32", "--batch-size", "8",
                             "--steps", "3", "--warmup-steps", "1", "--images", "48", "--unique", "6",
                             "--workers", "0", "--gpu-workers", "1", "--out", str(out)],
                            cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = json.loads((out / "input_pipeline.json").read_text())
    assert [r["name"] for r in runs] == ["raw loop, synthetic", "hvdtrain bench, synthetic", "epoch, synthetic data",
                                         "epoch, JPEGs, CPU decoding, 0 workers", "epoch, JPEGs, nvimgcodec, 1 workers"]
    assert all(r["exit"] == 0 and r["images_per_sec"] > 0 and r["cores_busy"] > 0 for r in runs)
    for epoch in runs[2:]:
        assert (epoch["steps"], epoch["samples"]) == (3, 24), epoch  # 3 steps of 8 images each
    assert len(list((out / "jpegs" / "train").rglob("*.JPEG"))) == 48
    assert "cores to feed raw" in result.stdout
