"""``benchmarks/data_scale.py`` at tiny sizes, each measurement once: every row asked for is there,
and the work it timed was done (files indexed, samples drawn through the loader and the sampler,
the index shared by 2 ranks launched for real, once mapped and once sent). The figures themselves
are the benchmark's (benchmarks/results/file-lists-at-scale_amd-epyc-2core_2026-11-25.md has them,
with their commands), not the suite's."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.helpers import REPO, job_env


@pytest.mark.slow
def test_data_scale_benchmark_measures_every_row(tmp_path):
    # 300 files in a folder, 2,000 in a synthetic index; the 2-rank broadcast (one launch) for the
    # folder alone: it is the same call on both.
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data_scale.py"), "--sizes", "300,2k",
                           "--folder-max", "1k", "--broadcast-max", "1k", "--workers", "0,2", "--runs", "1",
                           "--batch", "4", "--batches", "3", "--root", str(tmp_path), "--json", str(out)],
                          cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    printed = [json.loads(line.split("data_scale: ", 1)[1]) for line in done.stdout.splitlines()
               if line.startswith("data_scale: {")]
    assert printed == rows and [(r["n"], r["workers"]) for r in rows] == [(300, 0), (300, 2), (2000, 0), (2000, 2)]
    for row in rows:
        synthetic = row["n"] > 1000
        assert row["synthetic"] is synthetic and row["files"] == row["n"] and row["val_files"] > 0
        assert (row["scan_s"] is None) is synthetic and row["cache_bytes"] > 20 * row["n"]
        assert len(row["load_s"]) == 2 and all(s > 0 for s in row["load_s"])
        assert len(row["broadcast_mapped_s"]) == len(row["broadcast_sent_s"]) == (0 if synthetic else 1)
        assert row["sampler_drawn"] == math.ceil(row["n"] / 8) and len(row["sampler_start_s"]) == 2
        assert len(row["sampler_first_start_s"]) == len(row["sampler_next_start_s"]) == 1
        assert len(row["sampler_peak"]) == len(row["sampler_draw_s"]) == 2
        # The loader drew its batches: 3 of 4 samples; without files (synthetic) each one a bad file.
        assert row["samples"] == 12 and row["bad_files"] == (12 if synthetic else 0)
        assert all(p > 100 << 20 for p in row["pss_peak"]) and row["loader_iter_s"][0] >= 0
        if row["workers"]:
            assert row["processes"] >= 4 and row["worker_private"][0] > 1 << 20 and len(row["per_worker"]) == 1
    assert f"{2000:,} (synthetic) | 2 |" in done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hvdtrain-data-scale-")]  # cleaned up


def test_sampler_rows_alone_alternate_two_versions(tmp_path):
    # --sampler-only needs no folder; --sampler-before runs another sampler module (here the same
    # file) in turn with this one. 200k samples: enough for the next epoch to be drawn ahead.
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data_scale.py"), "--sizes", "200k",
                           "--sampler-only", "--sampler-before", str(REPO / "hvdtrain" / "data" / "sampler.py"),
                           "--runs", "1",
                           "--root", str(tmp_path), "--json", str(out)],
                          cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["n"], r["version"]) for r in rows] == [(200_000, "before"), (200_000, "after")]
    for row in rows:
        assert row["sampler_drawn"] == 25_000 and len(row["sampler_start_s"]) == 2
        assert len(row["sampler_first_start_s"]) == len(row["sampler_next_start_s"]) == 1
        assert len(row["sampler_peak"]) == len(row["sampler_draw_s"]) == 2 and all(p > 0 for p in row["sampler_peak"])
    assert "200,000 (before) | " in done.stdout and "sampler next start s" in done.stdout


def test_first_epoch_rows_time_the_draw_as_training_starts_it(tmp_path):
    # --first-epoch: a training loader (forkserver workers) over bare indices, its first batch with
    # the share drawn on the sampler's thread from set_epoch and with the share drawn before, in
    # turn. 200k samples: enough for the draw to go to the thread. One worker count, one run: two
    # fresh processes (the child is the same for every worker count).
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "data_scale.py"), "--sizes", "200k",
                           "--first-epoch", "--workers", "2", "--runs", "1", "--batch", "8", "--batches", "3",
                           "--root", str(tmp_path), "--json", str(out)],
                          cwd=tmp_path, env=job_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [(r["n"], r["workers"]) for r in rows] == [(200_000, 2)]
    for row in rows:
        # Each child checked that its first batch is the share's first 8 indices, then drew 2 more.
        assert row["share"] == 25_000 and row["samples"] == 24
        assert len(row["first_batch_ahead_s"]) == len(row["first_batch_drawn_s"]) == len(row["draw_wait_s"]) == 1
        assert all(s > 0 for s in row["first_batch_ahead_s"] + row["first_batch_drawn_s"] + row["sampler_draw_s"])
        assert row["draw_wait_s"] == [a - b for a, b in zip(row["first_batch_ahead_s"], row["first_batch_drawn_s"])]
    assert "wait for the draw s" in done.stdout and "200,000 | 2 | " in done.stdout
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("hvdtrain-data-scale-")]  # cleaned up
