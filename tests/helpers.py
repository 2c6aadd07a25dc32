"""Helpers shared by the test modules: paths, the job environment and a runner for really
launched multi-rank jobs. Import them as ``from tests.helpers import launch, PROBE``: tests/ and
its folders are packages, so pytest makes the repository root importable. Fixtures stay in the
conftest.py files."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from tests import shared_ranks

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROBE = REPO / "tests" / "parallel" / "probe.py"
JOB_TIMEOUT = 600


def job_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": "1",
        "HVDTRAIN_CACHE": str(tmp_path / "cache"),
        # Tests run as root in CI containers; Open MPI refuses that unless told.
        "OMPI_ALLOW_RUN_AS_ROOT": "1",
        "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
        # Cross-memory attach is often forbidden in containers; shared memory copies still work.
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",
        "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}",
        # dist.engine=torch: the job's secret (comm/job_store.py), one per job, as a job script exports it.
        "HVDTRAIN_JOB_SECRET": secrets.token_hex(32),
    })
    return env


def launch_command(kind: str, np_: int, program: list[str]) -> list[str]:
    """The argv that starts ``program`` (argv after the interpreter) on ``np_`` local ranks."""
    python = [str(BIN / "python")] + program
    if kind == "single":
        return python
    if kind in ("horovodrun-gloo", "horovodrun-mpi"):
        controller = "--gloo" if kind == "horovodrun-gloo" else "--mpi"
        return [str(BIN / "horovodrun"), "-np", str(np_), "-H", f"localhost:{np_}", controller] + python
    if kind == "mpirun":
        return ["mpirun", "-np", str(np_), "--oversubscribe", "-bind-to", "none", "-map-by", "slot"] + python
    if kind == "torchrun":  # dist.engine=torch; rank 0's store on a port free now (bound, then let go)
        return [str(BIN / "python"), "-m", "torch.distributed.run", "--nproc_per_node", str(np_),
                "--master_addr", "127.0.0.1", "--master_port", str(free_port())] + program
    raise ValueError(kind)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago: bound to port 0, read, released."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(kind: str, np_: int, program: list[str], tmp_path: Path, timeout: int = JOB_TIMEOUT,
           check: bool = True, env: dict[str, str] | None = None,
           own_launch: bool = False) -> subprocess.CompletedProcess:
    """Run ``program`` (argv after the interpreter) on ``np_`` ranks of a ``kind`` launcher; ``env``
    adds variables to the job's environment. The job runs on the shared ranks of that launcher
    (tests/shared_ranks) where they can stand for a fresh launch; ``own_launch`` launches it for real
    (a test whose subject is the launch: its processes, signals, placement or output)."""
    cmd = launch_command(kind, np_, program)
    job_environment = {**job_env(tmp_path), **(env or {})}
    result = None
    if not own_launch and shared_ranks.accepts(kind, np_, program):
        result = shared_ranks.run(kind, np_, program, tmp_path, job_environment, timeout)
    if result is None:
        result = subprocess.run(cmd, cwd=tmp_path, env=job_environment, capture_output=True, text=True,
                                timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {result.returncode}\n--- stdout\n{result.stdout[-4000:]}"
                             f"\n--- stderr\n{result.stderr[-4000:]}")
    return result


def training_processes(marker: str) -> dict[int, dict[str, str]]:
    """Python processes whose argv contains ``marker`` (e.g. their output dir), with their
    environment: the ranks themselves, not launchers or loader workers (whose argv lacks it)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"python") and marker.encode() in b" ".join(argv):
            found[int(entry.name)] = dict(v.decode(errors="replace").split("=", 1) for v in environ if b"=" in v)
    return found


def wait_for_line(job: subprocess.Popen, text: str, timeout: float = 180, lines: list[str] | None = None) -> list[str]:
    """Read ``job``'s output until a line contains ``text``; returns (and extends) the lines read.

    The deadline holds while the job prints nothing: each line is read by a helper thread that the
    wait gives up on at the deadline (a plain ``readline()`` would block past it for as long as a
    hung job keeps its pipe open). The job's later output stays readable through ``job.stdout``."""
    lines, deadline = ([] if lines is None else lines), time.monotonic() + timeout
    while (line := _readline_before(job.stdout, deadline)) is not None:
        if not line:
            raise AssertionError(f"'{text}' never appeared before the output ended:\n{''.join(lines)[-3000:]}")
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"'{text}' did not appear within {timeout:g} s:\n{''.join(lines)[-3000:]}")


def _readline_before(stream, deadline: float) -> str | None:
    """One line of ``stream`` ('' at its end), or None when none came before ``deadline``."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return None
    read: list[str] = []
    reader = threading.Thread(target=lambda: read.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(remaining)
    return read[0] if read else None


DEBUG = ["--config", "debug"]


def tiny(tiny_data: Path, out: Path, *extra: str) -> list[str]:
    return DEBUG + [f"data.dir={tiny_data}", f"output.dir={out}", *extra]


def read_metrics(run_dir: Path) -> list[dict]:
    """metrics.jsonl's records, each with its per-rank part (``by_rank``, every straggler) from
    metrics_ranks.jsonl, as ``hvdtrain report`` reads them."""
    from hvdtrain.observe.rank_logs import attach_rank_detail

    return attach_rank_detail([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()],
                              run_dir)


# N ranks x B images must take the same optimizer steps as 1 rank x N*B: the same global batches in
# the same order, BatchNorm statistics over the global batch (SyncBN), averaged gradients. Tiny
# BatchNorm batches make this network chaotic: float32 rounding (which depends on the processor and
# the thread count) grows about 5x per step, so the comparison runs in float64, where rounding
# starts ~1e-9 times smaller. Momentum and weight decay stay on, over steps that cross an epoch
# boundary. Measured on a 2-core AMD EPYC: parameters agree to 3.3e-13 (float64); the same run in
# float32 is 1.2e-2 apart, and without SyncBN 2.3 apart. The tolerance (atol 1e-9) leaves a margin
# of ~3,000 below it and ~1e9 above it for broken semantics.
REFERENCE_ARGS = ["model.sync_bn=true", "model.dtype=float64", "data.augment=false", "train.epochs=2",
                  "train.steps_per_epoch=3", "optim.base_lr=0.1", "optim.momentum=0.9", "optim.weight_decay=1e-4"]


def assert_matches_one_rank(one_probe: Path, one_run: Path, two_probe: Path, two_run: Path) -> dict:
    """A 2-rank run (``REFERENCE_ARGS``, batch 4) ended where the 1-rank run (batch 8) did: parameters,
    logged losses, accuracies and learning rates. Returns the 2-rank job's rank 0 record."""
    import pytest

    two = torch.load(two_probe / "rank0.pt", weights_only=False)
    one = torch.load(one_probe / "rank0.pt", weights_only=False)
    assert two["step"] == one["step"] == 6
    compared = 0
    for key, value in one["state"].items():
        if value.is_floating_point():
            assert value.dtype == torch.float64, key
            torch.testing.assert_close(two["state"][key], value, rtol=1e-8, atol=1e-9, msg=key)
            compared += 1
    assert compared > 100
    # Same global batches, same learning rate: the logged losses and accuracies agree too.
    records = list(zip(read_metrics(one_run), read_metrics(two_run)))
    assert [a["split"] for a, _ in records] == ["train", "val", "train", "val"]
    for a, b in records:
        assert (a["split"], a["samples"], a["step"]) == (b["split"], b["samples"], b["step"])
        assert a["lr"] == pytest.approx(b["lr"], rel=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-8)
        assert (a["top1"], a["top5"]) == (b["top1"], b["top5"])
    return two


def tb_scalars(run_dir: Path, folder: Path | None = None) -> dict[str, list[tuple[int, float]]]:
    """The run's TensorBoard scalars as TensorBoard itself reads them (its EventAccumulator, which
    applies the purge marks of resumed runs), from its tb/ or ``folder``: tag -> [(global step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder or run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def final_states(probe_dir: Path) -> list[dict]:
    return [torch.load(probe_dir / f"rank{r}.pt", weights_only=False)["state"] for r in range(2)]


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [key for key in a if not torch.equal(a[key], b[key])]
    assert different == [], f"{len(different)} tensors differ, e.g. {different[:3]}"


def rank_pids(marker: str) -> dict[int, int]:
    """rank -> PID of the training processes whose argv has ``marker``."""
    found = {}
    for pid, environ in training_processes(marker).items():
        for key in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK"):
            if key in environ:
                found[int(environ[key])] = pid
    return found


def start_job(kind: str, program: list[str], tmp: Path) -> subprocess.Popen:
    """``launch`` on 2 ranks without waiting: the job, its output merged into one pipe."""
    return subprocess.Popen(launch_command(kind, 2, program), cwd=tmp, env=job_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def example_task_variant(folder: Path, name: str, subclass_source: str) -> Path:
    """``folder/name.py``: examples/custom_task's tabular task followed by ``subclass_source`` (a
    subclass of ``TabularTask`` that a test injects a fault with, or adds a metric to)."""
    path = folder / f"{name}.py"
    path.write_text((REPO / "examples" / "custom_task" / "tabular_task.py").read_text() + subclass_source)
    return path


def stopped_by_sigterm(launcher: list[str], run_dir: Path, line: str, tmp_path: Path) -> tuple[int, str]:
    """Start ``launcher`` (a 2-rank job), SIGTERM both ranks once ``line`` shows: (the launcher's exit
    code, its whole output)."""
    job = subprocess.Popen(launcher, cwd=tmp_path, env=job_env(tmp_path), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    try:
        lines = wait_for_line(job, line)
        pids = rank_pids(str(run_dir))
        assert sorted(pids) == [0, 1], pids
        for pid in pids.values():
            os.kill(pid, signal.SIGTERM)
        rest, _ = job.communicate(timeout=120)
    finally:
        job.kill()
    return job.returncode, "".join(lines) + rest


# Runs like python -m hvdtrain; right after global step VANISH_AT_STEP rank 0 deletes VANISH_PATH (a
# file, or a folder's files) and every rank waits for it, so that no rank reads ahead of the deletion.
VANISHING = '''
import os
import sys
from pathlib import Path


def main():
    from hvdtrain.comm import dist
    from hvdtrain.train import trainer
    from hvdtrain.cli import main as hvdtrain_main

    step, path = int(os.environ["VANISH_AT_STEP"]), Path(os.environ["VANISH_PATH"])
    after_step = trainer.Trainer.after_step

    def vanishing(self, out, sums, progress):
        after_step(self, out, sums, progress)
        if self.run.state.position.step == step:
            if dist.rank() == 0:
                for gone in (sorted(path.iterdir()) if path.is_dir() else [path]):
                    gone.unlink()
            dist.barrier()

    trainer.Trainer.after_step = vanishing
    try:
        code = hvdtrain_main(sys.argv[1:])
    finally:
        trainer.Trainer.after_step = after_step
    sys.exit(code)


# tests/shared_ranks: this script may run on the shared ranks
if __name__ == "__main__":  # loader workers (forkserver) import this file: train only when run
    main()
'''
