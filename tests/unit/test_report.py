"""``hvdtrain report``: PNG plots and a summary from metrics.jsonl; the bench's interval arithmetic."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from PIL import Image

from hvdtrain.cli import main
from hvdtrain.tools import report
from hvdtrain.tools.bench import interval95

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def legacy_records(epochs: int = 3) -> list[dict]:
    """metrics.jsonl as older runs wrote it: no step phases, no CPU or GPU use, images_per_sec."""
    lines = []
    for epoch in range(epochs):
        lines.append({"split": "train", "epoch": epoch, "step": 4 * (epoch + 1), "loss": 2.0 - 0.3 * epoch,
                      "top1": 20.0 + 10 * epoch, "top5": 60.0, "samples": 64, "seconds": 2.0,
                      "lr": 0.1 * (1 - epoch / epochs), "samples_per_sec": 30.0 + epoch,
                      "data_wait_fraction": 0.05})
        lines.append({"split": "val", "epoch": epoch, "step": 4 * (epoch + 1), "loss": 2.1 - 0.3 * epoch,
                      "top1": 15.0 + 12 * epoch, "top5": 55.0, "samples": 21, "seconds": 0.5, "lr": 0.1,
                      "images_per_sec": 40.0})  # the old name, still read
    return lines


def write_run(run_dir: Path, epochs: int = 3) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in legacy_records(epochs)))


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


def full_records(epochs: int) -> list[dict]:
    """What a run of today writes: phases, CPU and GPU use, a straggler, EMA, a reached target."""
    records = []
    for epoch in range(epochs):
        train = {"split": "train", "epoch": epoch, "step": 10 * (epoch + 1), "loss": 6.0 / (epoch + 1), "top1": 70.0,
                 "top5": 90.0, "lr": 0.1, "samples_per_sec": 4000.0 + epoch % 7, "data_wait_fraction": 0.1,
                 "phase_data": 0.1, "phase_compute": 0.6, "phase_allreduce": 0.2, "phase_optimizer": 0.05,
                 "phase_other": 0.05, "cpu_percent": 250.0, "workers_cpu_percent": 700.0, "workers_cpu_share": 0.7,
                 "gpu_util_percent": 96.0, "gpu_util_percent_min": 93.0}
        if epoch == 0:
            train["stragglers"] = [{"rank": rank, "host": f"node{rank}", "slower": 0.3, "phase": "data",
                                    "phase_fraction": 0.4} for rank in range(12)]
        val = {"split": "val", "epoch": epoch, "step": 10 * (epoch + 1), "loss": 5.0 / (epoch + 1), "top1": 71.0,
               "top5": 91.0, "samples_per_sec": 12000.0, "ema_top1": 72.0, "target_reached": True, "target": 70.0,
               "epochs_to_target": 1, "time_to_target_seconds": 300.0}
        records += [train, val]
    return records


def overlap(a, b, tolerance: float = 1.0) -> bool:
    return a.x0 + tolerance < b.x1 and b.x0 + tolerance < a.x1 and a.y0 + tolerance < b.y1 and b.y0 + tolerance < a.y1


def inside(box, page, tolerance: float = 1.0) -> bool:
    return (box.x0 >= page.x0 - tolerance and box.y0 >= page.y0 - tolerance and box.x1 <= page.x1 + tolerance
            and box.y1 <= page.y1 + tolerance)


@pytest.mark.parametrize("records", [full_records(1), full_records(2), full_records(8), full_records(90),
                                     legacy_records()], ids=["1-epoch", "2-epochs", "8-epochs", "90-epochs", "legacy"])
def test_report_layout_clips_and_covers_nothing(records):
    """Every panel's title, tick labels and legend, and the summary, lie inside the picture; no legend
    lies on a plotting area; no two panels (with their labels, legends and text) overlap."""
    import matplotlib.pyplot as plt

    splits = report.by_split(records)
    run_dir = Path("/runs/" + "a-rather-long-folder-name-" * 6)  # a summary line longer than the figure is wide
    summary = report.summary_lines(run_dir, splits)
    figure = report.draw(splits, title=f"hvdtrain run {run_dir.name}", summary=summary)
    try:
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        page = figure.bbox
        assert inside(figure._suptitle.get_window_extent(renderer), page)
        plotting_areas = [axis.get_window_extent(renderer) for axis in figure.axes if axis.axison]
        assert len(plotting_areas) == 6
        for axis in figure.axes:
            assert inside(axis.get_tightbbox(renderer), page), f"'{axis.get_title()}' is cut off"
            assert not overlap(figure._suptitle.get_window_extent(renderer), axis.get_tightbbox(renderer))
            legend = axis.get_legend()
            if legend is not None:
                for area in plotting_areas:
                    assert not overlap(legend.get_window_extent(renderer), area), \
                        f"the legend of '{axis.get_title()}' covers a plot"
        for first, second in itertools.combinations(figure.axes, 2):
            assert not overlap(first.get_tightbbox(renderer), second.get_tightbbox(renderer)), \
                f"'{first.get_title()}' and '{second.get_title() or 'the summary'}' overlap"
        text = [text for axis in figure.axes if not axis.axison for text in axis.texts]
        assert len(text) == 1 and "a-rather-long-folder-name" in text[0].get_text()
        assert inside(text[0].get_window_extent(renderer), page)
    finally:
        plt.close(figure)


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
