"""runtime.host_malloc (hvdtrain/launch/host_malloc.py): which settings a rank asks glibc for, when the
environment's choice wins, and, in a child process, that a tuned process stops faulting a step's
memory in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from hvdtrain.launch import host_malloc


class Recorder:
    def __init__(self, answer: int = 1, refuse: tuple[int, ...] = ()):
        self.calls: list[tuple[int, int]] = []
        self.answer, self.refuse = answer, refuse

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return 0 if param in self.refuse else self.answer


@pytest.mark.parametrize("mode,device,asked", [("auto", "cpu", True), ("auto", "cuda", False), ("tuned", "cuda", True),
                                               ("tuned", "cpu", True), ("system", "cpu", False)])
def test_auto_tunes_cpu_ranks_only(mode, device, asked):
    mallopt = Recorder()
    said = host_malloc.apply(mode, device, env={}, mallopt=mallopt)
    if asked:
        assert said == "tuned"
        assert dict(mallopt.calls) == {host_malloc.M_MMAP_MAX: 0, host_malloc.M_TRIM_THRESHOLD: 1 << 30,
                                       host_malloc.M_TOP_PAD: 64 << 20}
    else:
        assert said is None and mallopt.calls == []


@pytest.mark.parametrize("env,named", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "jemalloc in LD_PRELOAD"),
    ({"LD_PRELOAD": "/opt/libtcmalloc_minimal.so.4"}, "tcmalloc in LD_PRELOAD"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=0"}, "GLIBC_TUNABLES"),
    ({"MALLOC_TRIM_THRESHOLD_": "1000000"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
])
def test_the_environments_choice_wins(env, named):
    mallopt = Recorder()
    assert host_malloc.apply("tuned", "cpu", env=env, mallopt=mallopt) == f"as {named} sets it"
    assert mallopt.calls == []


def test_unrelated_preloads_and_tunables_do_not_count():
    mallopt = Recorder()
    env = {"LD_PRELOAD": "/usr/lib/libfaketime.so", "GLIBC_TUNABLES": "glibc.pthread.rseq=0"}
    assert host_malloc.apply("auto", "cpu", env=env, mallopt=mallopt) == "tuned"
    assert len(mallopt.calls) == 3


def test_a_refusal_is_said():
    said = host_malloc.apply("tuned", "cpu", env={}, mallopt=Recorder(refuse=(host_malloc.M_TOP_PAD,)))
    assert said == "partly tuned (mallopt refused M_TOP_PAD)"
    assert host_malloc.apply("tuned", "cpu", env={}, mallopt=Recorder(answer=0)).startswith("defaults")


def test_without_glibc_nothing_is_set(monkeypatch):
    monkeypatch.setattr(host_malloc, "glibc_mallopt", lambda: None)
    assert host_malloc.apply("tuned", "cpu", env={}) == "the C library's defaults (not glibc)"


FAULTS = r"""
import resource, sys, torch
from hvdtrain.launch import host_malloc
if sys.argv[1] == "tuned":
    assert host_malloc.apply("tuned", "cpu", env={}) == "tuned"
torch.set_num_threads(1)
def step():  # a step's worth of large blocks (40 MiB each), allocated, used and freed
    blocks = [torch.ones(10 << 20) for _ in range(2)]
    return sum(float(b[-1]) for b in blocks)
for _ in range(8):  # the heap settles in the first few steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


@pytest.mark.skipif(host_malloc.glibc_mallopt() is None, reason="glibc's mallopt")
def test_a_tuned_process_keeps_a_steps_memory():
    """Two blocks of 40 MiB per step (an activation of resnet18 at 224 px, batch 16, is 51 MiB): glibc's
    defaults serve a block above 32 MiB from mmap whatever its dynamic threshold, so every step faults
    its 20,480 pages in again; tuned, the heap keeps them and a step faults (almost) nothing in."""
    per_step = {}
    for mode in ("system", "tuned"):
        out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True)
        per_step[mode] = float(out.stdout.split()[-1])
    assert per_step["system"] > 15_000 and per_step["tuned"] < 1_000, per_step


def test_the_benchmark_runs_both_contenders_through_their_steps(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "host_malloc.py"
    spec = importlib.util.spec_from_file_location("host_malloc_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(["--image-size", "32", "--batch-size", "2", "--warmup-steps", "1", "--steps", "2",
                          "--pairs", "1", "--out", str(tmp_path)])
    assert [run["steps"] for mode in ("defaults", "tuned") for run in result["runs"][mode]] == [2, 2]
    assert result["runs"]["tuned"][0]["malloc"] == "tuned" and result["runs"]["defaults"][0]["malloc"] is None
    assert all(run["seconds_per_step"] > 0 and run["peak_rss_mb"] > 0 for runs in result["runs"].values() for run in runs)
    assert len(result["paired_ratios"]) == 1
    assert json.loads((tmp_path / "host_malloc.json").read_text())["paired_ratios"] == result["paired_ratios"]
