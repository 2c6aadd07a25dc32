"""What a run reports about itself besides its metrics: every rank's step phases and host
statistics gathered at the end of an epoch (stragglers named), and Horovod's timeline over a
window of global steps. Used by train/run.py; ``run`` arguments are run.Run objects.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..comm import dist
from ..comm import launcher_env as launcher
from . import phases, rank_logs
from .sysstats import across_ranks


class TimelineWindow:
    """Horovod's timeline for the whole run, or for the global steps [start, end) of
    ``runtime.timeline_steps``: ``at_step(step)`` before every step, ``close()`` at the end."""

    def __init__(self, path: str, steps: tuple[int, int] | None):
        self.path, self.steps = path, steps
        self.recording = self.done = False

    def at_step(self, step: int) -> None:
        if self.done:
            return
        start, end = self.steps if self.steps else (0, None)
        if not self.recording and step >= start and (end is None or step < end):
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            dist.start_timeline(self.path, mark_cycles=True)
            self.recording = True
            dist.log(f"hvdtrain: recording Horovod's timeline to {self.path} from global step {step}"
                + (f" to {end}" if end is not None else ""))
        elif self.recording and end is not None and step >= end:
            self.close()

    def close(self) -> None:
        if self.recording:
            dist.stop_timeline()
            dist.log(f"hvdtrain: timeline written to {self.path} (open it in Perfetto, ui.perfetto.dev, "
                f"or chrome://tracing)")
        self.recording, self.done = False, True


def add_rank_report(run: Any, train_metrics: dict[str, Any]) -> None:
    """Every rank's step phases, host statistics and warnings -> the epoch's figures in
    ``train_metrics`` (phase fractions, CPU/memory/GPU use, ``by_rank``), the stragglers, which rank
    0 logs (the worst few and a count: rank_logs), and each warning the ranks raised, said once
    with its count. A collective."""
    mine: dict[str, Any] = {"rank": dist.rank(), "host": launcher.host_name()}
    phase_seconds = train_metrics.pop("rank_phases", None)
    if run.cfg.runtime.phase_timing and phase_seconds is not None:
        mine["phases"] = phase_seconds
    if run.stats is not None:
        mine["stats"] = run.stats.take_epoch()
    tally = getattr(run, "warnings", None)
    if tally is not None:  # the same on every rank (run.setup installs one everywhere)
        mine["warnings"] = tally.take()
    if len(mine) == 2:
        return
    ranks = dist.allgather_object(mine, name="hvdtrain.rank_report")
    if tally is not None:
        for line in rank_logs.summary_lines([r["warnings"] for r in ranks], tally.said, run.state.position.epoch):
            dist.log(line)
    if "phases" not in mine and run.stats is None:
        return
    by_rank: dict[int, dict[str, Any]] = {r["rank"]: {"rank": r["rank"], "host": r["host"]} for r in ranks}
    if run.stats is not None:
        train_metrics.update(across_ranks([r["stats"] for r in ranks]))
        for r in ranks:
            by_rank[r["rank"]].update({k: round(v, 4) for k, v in r["stats"].items() if k != "stats_samples"})
    if "phases" in mine:
        timed = [{**r["phases"], "rank": r["rank"], "host": r["host"]} for r in ranks]
        phase_figures = phases.epoch_phases(timed)
        for row in phase_figures.pop("by_rank", []):
            by_rank[row["rank"]].update(row)
        train_metrics.update(phase_figures)
        stragglers = phases.find_stragglers(timed, run.cfg.dist.straggler_threshold)
        if stragglers:  # metrics.jsonl keeps the worst few and the count; metrics_ranks.jsonl all
            train_metrics["stragglers"], train_metrics["stragglers_total"] = stragglers, len(stragglers)
        for line in rank_logs.straggler_lines(stragglers, run.cfg.dist.straggler_threshold, len(ranks),
                                              phases.straggler_line):
            dist.log(line)
    train_metrics["by_rank"] = [by_rank[rank] for rank in sorted(by_rank)]
