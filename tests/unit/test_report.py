"""``hvdtrain report``: PNG plots and a summary from metrics.jsonl; the bench's interval arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from hvdtrain.tools.bench import interval95
from hvdtrain.cli import main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, epochs: int = 3) -> None:
    run_dir.mkdir(parents=True)
    lines = []
    for epoch in range(epochs):
        lines.append({"split": "train", "epoch": epoch, "step": 4 * (epoch + 1), "loss": 2.0 - 0.3 * epoch,
                      "top1": 20.0 + 10 * epoch, "top5": 60.0, "samples": 64, "seconds": 2.0,
                      "lr": 0.1 * (1 - epoch / epochs), "samples_per_sec": 30.0 + epoch,
                      "data_wait_fraction": 0.05})
        lines.append({"split": "val", "epoch": epoch, "step": 4 * (epoch + 1), "loss": 2.1 - 0.3 * epoch,
                      "top1": 15.0 + 12 * epoch, "top5": 55.0, "samples": 21, "seconds": 0.5, "lr": 0.1,
                      "images_per_sec": 40.0})  # the old name, still read
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_report_writes_a_png_and_a_summary(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    png = run_dir / "report.png"
    assert f"report={png}" in out
    assert "run " in out and "3 epoch(s)" in out
    assert "best top-1 39.00% at epoch 3" in out
    assert "data wait 5.0%" in out
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(png) as image:
        image.verify()
    with Image.open(png) as image:
        width, height = image.size
        assert image.format == "PNG" and width >= 800 and height >= 200
    assert (run_dir / "summary.txt").read_text().splitlines()[0] == out.splitlines()[0]


def test_report_shows_where_step_time_goes_and_cpu_gpu_use(tmp_path, capsys):
    run_dir = tmp_path / "run"
    write_run(run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if record["split"] == "train":
            record.update(phase_data=0.1, phase_compute=0.6, phase_allreduce=0.2, phase_optimizer=0.05,
                          phase_other=0.05, cpu_percent=95.0, workers_cpu_share=0.25, gpu_util_percent=90.0,
                          gpu_util_percent_min=85.0)
            if record["epoch"] == 1:
                record["stragglers"] = [{"rank": 1, "host": "node1", "slower": 0.3, "phase": "data",
                                         "phase_fraction": 0.4}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert ("step time (mean over epochs and ranks): data wait 10.0%, forward+backward 60.0%, "
            "allreduce wait 20.0%, optimizer 5.0%, other 5.0%") in out
    assert "stragglers: rank(s) 1 in 1 of 3 epochs" in out
    assert "CPU 95% of a core (loader workers 25% of it), GPU busy 90% (least busy rank 85%)" in out
    assert (run_dir / "report.png").read_bytes()[:8] == PNG_SIGNATURE


def test_report_of_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has no metrics.jsonl" in err


def test_interval95_uses_students_t():
    mean, half = interval95([10.0, 12.0])
    assert mean == 11.0 and half == pytest.approx(12.706)  # t(0.975, 1) x stdev sqrt(2) / sqrt(2)
    mean, half = interval95([5.0, 5.0, 5.0])
    assert (mean, half) == (5.0, 0.0)
    assert interval95([7.0]) == (7.0, 0.0)
