"""``python -m hvdtrain report RUN_DIR``: a run's metrics.jsonl as PNG plots and a text summary.

Plots per epoch: loss and top-1 (train and val), learning rate, images per second, where the
step time goes (a stacked chart of the phases: data wait, forward+backward, allreduce wait,
optimizer, other; the data-wait fraction alone for runs from before phase timing) and the ranks'
CPU and GPU use. Written next to the metrics (``RUN_DIR/report.png``,
``RUN_DIR/summary.txt``) unless ``--out`` says otherwise, into a folder of the user's that nobody
else can write (hvdtrain/ownership.py), never through a link; private to the user (0600). Any run's
metrics can be read, another user's too.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..data import DataError
from ..observe.phases import LABELS, PHASES
from ..observe.rank_logs import MAX_METRICS_BYTES, RANKS_FILE, TooLarge, attach_rank_detail, rank_ranges, stream_lines
from ..ownership import own_folder, replace_file, write_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def load_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of ``run_dir``'s metrics.jsonl, read as a stream up to MAX_METRICS_BYTES (a larger
    file, a sparse one included, is one line), each with its per-rank part."""
    path = run_dir / "metrics.jsonl"
    records = []
    try:
        for number, line in stream_lines(path, MAX_METRICS_BYTES):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:  # not JSON, or not UTF-8
                raise DataError(f"{path}:{number} is not a JSON line (the file is damaged)") from None
            epoch = record.setdefault("epoch", 0) if isinstance(record, dict) else None
            if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
                raise DataError(f"{path}:{number} is not a metrics record (an object with an epoch number): "
                                f"the file is damaged or not hvdtrain's")
            records.append(record)
        if not records:
            raise DataError(f"{path} is empty: the run has not finished an epoch yet")
        return attach_rank_detail(records, run_dir)  # by_rank, every straggler (older runs: inline)
    except FileNotFoundError:
        raise DataError(f"'{run_dir}' has no metrics.jsonl (give the output.dir of a training run)") from None
    except TooLarge as error:
        raise DataError(str(error)) from None


def numeric(record: dict[str, Any], key: str) -> float | None:
    """``record[key]`` when it is a number (a record of an older or other run may lack it, or hold text)."""
    value = record.get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def shown(record: dict[str, Any], key: str, spec: str) -> str:
    value = numeric(record, key)
    return "n/a" if value is None else format(value, spec)


def by_split(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Records per split, one per epoch (the last one wins when a resumed run repeated an epoch)."""
    splits: dict[str, dict[int, dict[str, Any]]] = {}
    for record in records:
        if "images_per_sec" in record:  # metrics.jsonl of hvdtrain before the task interface
            record.setdefault("samples_per_sec", record.pop("images_per_sec"))
        splits.setdefault(record.get("split", "train"), {})[int(record.get("epoch", 0))] = record
    return {split: [epochs[e] for e in sorted(epochs)] for split, epochs in splits.items()}


def summary_lines(run_dir: Path, splits: dict[str, list[dict[str, Any]]]) -> list[str]:
    train, val = splits.get("train", []), splits.get("val", [])
    epochs = max(len(train), len(val))
    lines = [f"run {run_dir}: {epochs} epoch(s)"]
    if train:
        last = train[-1]
        rates = [r["samples_per_sec"] for r in train if numeric(r, "samples_per_sec") is not None]
        waits = [r["data_wait_fraction"] for r in train if numeric(r, "data_wait_fraction") is not None]
        speed = (f"; {sum(rates) / len(rates):.1f} img/s on average (last {rates[-1]:.1f})" if rates
                 else "; no throughput recorded")
        lines.append(f"train: last epoch loss {shown(last, 'loss', '.4f')}, top-1 {shown(last, 'top1', '.2f')}%{speed}"
                     + (f", data wait {100 * sum(waits) / len(waits):.1f}% of the time" if waits else ""))
    if val:
        last = val[-1]
        scored = [r for r in val if numeric(r, "top1") is not None and not math.isnan(r["top1"])]
        best = (f"; best top-1 {max(scored, key=lambda r: r['top1'])['top1']:.2f}% at epoch "
                f"{int(max(scored, key=lambda r: r['top1']).get('epoch', 0)) + 1}") if scored else ""
        lines.append(f"val: last epoch loss {shown(last, 'loss', '.4f')}, top-1 {shown(last, 'top1', '.2f')}%, "
                     f"top-5 {shown(last, 'top5', '.2f')}%{best}")
    if val and any("ema_top1" in r for r in val):
        best = max((r for r in val if "ema_top1" in r), key=lambda r: r["ema_top1"])
        lines.append(f"val (EMA weights): last epoch top-1 {val[-1].get('ema_top1', float('nan')):.2f}%; "
                     f"best {best['ema_top1']:.2f}% at epoch {int(best['epoch']) + 1}")
    reached = [r for r in val if r.get("target_reached")]
    if reached:
        first = reached[0]
        lines.append(f"time to accuracy: target {first['target']:g} reached after {first['epochs_to_target']} "
                     f"epoch(s), {first['time_to_target_seconds']:.1f} s of training")
    if train and "lr" in train[-1]:
        lines.append(f"lr: {train[0]['lr']:.4g} (epoch 1) -> {train[-1]['lr']:.4g} (epoch {len(train)})")
    timed = [r for r in train if "phase_compute" in r]
    if timed:
        lines.append("step time (mean over epochs and ranks): " + ", ".join(
            f"{LABELS[p]} {100 * sum(r[f'phase_{p}'] for r in timed) / len(timed):.1f}%" for p in PHASES))
    stragglers = [(int(r["epoch"]) + 1, s) for r in train for s in r.get("stragglers", [])]
    if stragglers:
        ranks = sorted({s["rank"] for _, s in stragglers})
        epochs = len({e for e, _ in stragglers})
        lines.append(f"stragglers: rank(s) {rank_ranges(ranks).replace(',', ', ')} in {epochs} of "
                     f"{len(train)} epochs (see {RANKS_FILE if (run_dir / RANKS_FILE).is_file() else 'metrics.jsonl'} "
                     f"'stragglers')")
    used = [r for r in train if "cpu_percent" in r]
    if used:
        last = used[-1]
        line = f"last epoch per rank: CPU {last['cpu_percent']:.0f}% of a core"
        if "workers_cpu_share" in last:
            line += f" (loader workers {100 * last['workers_cpu_share']:.0f}% of it)"
        if "gpu_util_percent" in last:
            line += (f", GPU busy {last['gpu_util_percent']:.0f}% (least busy rank "
                     f"{last.get('gpu_util_percent_min', last['gpu_util_percent']):.0f}%)")
        lines.append(line)
    return lines


# Figure geometry, in inches at DPI: three panels a row, then the summary in a band of its own
# whose height follows its number of lines, so nothing is squeezed or drawn over.
DPI = 100
WIDTH_IN = 15.0
PANEL_ROW_IN = 3.3
SUMMARY_FONT_PT = 9
LINE_SPACING = 1.25
# DejaVu Sans Mono's advance is 0.602 em; the rest of the width is the figure's margins.
MONO_ADVANCE_EM = 0.602
# Up to this many epochs, points carry markers and the phases are bars; beyond, lines and areas.
MARKED_EPOCHS = 30


def summary_width_chars(width_in: float = WIDTH_IN, font_pt: float = SUMMARY_FONT_PT) -> int:
    """Characters of monospace text that fit across the figure, less its margins."""
    return int((width_in - 0.6) * 72 / (MONO_ADVANCE_EM * font_pt))


def wrap_summary(summary: list[str]) -> list[str]:
    """The summary's lines cut to the figure's width, continuations indented."""
    width = summary_width_chars()
    wrapped = []
    for line in summary:
        wrapped += textwrap.wrap(line, width, subsequent_indent="  ") or [""]
    return wrapped


def line_style(points: int) -> dict[str, Any]:
    """Markers on the points of a short run; a plain line where they would crowd into a smear."""
    return {"marker": "o", "markersize": 3} if points <= MARKED_EPOCHS else {"linewidth": 1.2}


def legend_outside(axis: Any, handles: list[Any] | None = None, labels: list[str] | None = None) -> None:
    """The legend right of the plotting area: it never covers a curve, and constrained layout
    makes room for it."""
    kwargs = {"handles": handles, "labels": labels} if handles is not None else {}
    axis.legend(**kwargs, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, fontsize=8,
                frameon=False)


def draw(splits: dict[str, list[dict[str, Any]]], title: str, summary: list[str]) -> Figure:
    """The report's figure, not saved: six panels in two rows of three, legends right of their
    plots, then the summary text in a band of its own, laid out by constrained layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    lines = wrap_summary(summary)
    summary_in = (len(lines) * LINE_SPACING * SUMMARY_FONT_PT) / 72 + 0.3
    figure = plt.figure(figsize=(WIDTH_IN, 2 * PANEL_ROW_IN + summary_in + 0.5), dpi=DPI, layout="constrained")
    grid = figure.add_gridspec(3, 3, height_ratios=[PANEL_ROW_IN, PANEL_ROW_IN, summary_in])
    axes = [figure.add_subplot(grid[row, column]) for row in range(2) for column in range(3)]
    panels = [("loss", "loss", ("train", "val")), ("top1", "top-1 (%)", ("train", "val")),
              ("lr", "learning rate (end of epoch)", ("train",)), ("samples_per_sec", "images / s", ("train", "val"))]
    for axis, (key, label, which) in zip(axes, panels):
        values = []
        for split in which:
            rows = [r for r in splits.get(split, []) if isinstance(r.get(key), (int, float))]
            if rows:
                values += [r[key] for r in rows]
                axis.plot([int(r["epoch"]) + 1 for r in rows], [r[key] for r in rows], label=split,
                          **line_style(len(rows)))
        axis.set_title(label, fontsize=10)
        if len(which) > 1 and axis.lines:
            legend_outside(axis)
        positive = [v for v in values if v > 0 and math.isfinite(v)]
        if key == "loss" and positive and max(positive) > 20 * min(positive):
            axis.set_yscale("log")  # an early spike would flatten the rest of the curve
    plot_phases(axes[4], splits.get("train", []))
    plot_usage(axes[5], splits.get("train", []))
    for axis in axes:
        axis.set_xlabel("epoch", fontsize=9)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        axis.tick_params(labelsize=8)
        axis.grid(alpha=0.3)
    text_axis = figure.add_subplot(grid[2, :])
    text_axis.axis("off")
    text_axis.text(0, 1, "\n".join(lines), va="top", ha="left", fontsize=SUMMARY_FONT_PT, family="monospace",
                   linespacing=LINE_SPACING, transform=text_axis.transAxes)
    figure.suptitle(title, fontsize=11)
    return figure


def plot(splits: dict[str, list[dict[str, Any]]], path: Path, title: str, summary: list[str]) -> None:
    """The figure written to ``path``, whose folder ``report_folder`` checked: a fresh file renamed over
    the name (ownership.replace_file), so a link planted there is replaced, never written through."""
    import matplotlib.pyplot as plt

    figure = draw(splits, title, summary)
    try:
        replace_file(path, lambda handle: figure.savefig(handle, format=path.suffix.lstrip(".").lower() or "png"))
    finally:
        plt.close(figure)


def report_folder(out: Path, given: bool) -> None:
    """The folder the report goes to, made or checked by the ownership rule (hvdtrain/ownership.py):
    the user's own, nobody else can write it. Reading another user's run is fine; writing into
    their folder is not."""
    fix = "write the report to a folder of yours with --out /a/folder/of/yours/report.png"
    own_folder(out.parent, what="report folder", fix=fix if not given else "give --out in a folder of yours")


def plot_phases(axis: Any, train: list[dict[str, Any]]) -> None:
    """Where the training step time goes, stacked per epoch (mean over ranks)."""
    timed = [r for r in train if "phase_compute" in r]
    if timed:
        epochs = [int(r["epoch"]) + 1 for r in timed]
        fractions = [[r[f"phase_{p}"] for r in timed] for p in PHASES]
        if len(timed) <= MARKED_EPOCHS:
            # Stacked bars, one per epoch: readable from a single epoch (an area needs two).
            bottom = [0.0] * len(timed)
            bands = []
            for phase, heights in zip(PHASES, fractions):
                bands.append(axis.bar(epochs, heights, bottom=bottom, width=0.8, label=LABELS[phase], alpha=0.85))
                bottom = [b + h for b, h in zip(bottom, heights)]
        else:  # bars of many epochs alias into stripes
            bands = axis.stackplot(epochs, *fractions, labels=[LABELS[p] for p in PHASES], alpha=0.85)
        # Listed top band first, as the bands are stacked.
        legend_outside(axis, bands[::-1], [LABELS[p] for p in PHASES][::-1])
        axis.set_title("train step time by phase (fraction)", fontsize=10)
    else:  # runs from before phase timing
        rows = [r for r in train if "data_wait_fraction" in r]
        axis.plot([int(r["epoch"]) + 1 for r in rows], [r["data_wait_fraction"] for r in rows],
                  **line_style(len(rows)))
        axis.set_title("data wait (fraction of train time)", fontsize=10)
    axis.set_ylim(0, 1)


def plot_usage(axis: Any, train: list[dict[str, Any]]) -> None:
    """CPU per rank (% of a core, mean over ranks) and, with NVML, GPU busy (mean and least busy rank)."""
    for key, label in (("cpu_percent", "CPU % / rank"), ("workers_cpu_percent", "loader workers CPU %"),
                       ("gpu_util_percent", "GPU busy % (mean)"), ("gpu_util_percent_min", "GPU busy % (least)")):
        rows = [r for r in train if isinstance(r.get(key), (int, float))]
        if rows:
            axis.plot([int(r["epoch"]) + 1 for r in rows], [r[key] for r in rows], label=label,
                      **line_style(len(rows)))
    if any("gpu_util_percent" in r for r in train):
        axis.axhline(95, color="grey", linestyle=":", linewidth=1, label="95% (rule of thumb)")
    axis.set_title("CPU and GPU use (train)", fontsize=10)
    if axis.lines:
        legend_outside(axis)
    else:  # runs from before host statistics
        axis.text(0.5, 0.5, "not recorded in this run", ha="center", va="center", fontsize=9, color="grey",
                  transform=axis.transAxes)


def cmd_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="hvdtrain report", description="PNG plots and a text summary of a "
                                     "training run's metrics.jsonl.")
    parser.add_argument("run_dir", help="the run's output.dir (holding metrics.jsonl)")
    parser.add_argument("--out", help="PNG file to write (default RUN_DIR/report.png)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run_dir)
    splits = by_split(load_records(run_dir))
    out = Path(args.out) if args.out else run_dir / "report.png"
    report_folder(out, given=bool(args.out))
    lines = summary_lines(run_dir, splits)
    plot(splits, out, title=f"hvdtrain run {run_dir.name}", summary=lines)
    write_atomic(out.parent / "summary.txt", "\n".join(lines) + "\n")
    for line in lines:
        print(line)
    print(f"report={out}", flush=True)
    return 0
