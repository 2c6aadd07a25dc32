"""The traps the doctor names (doctor_checks.py) and how it finds its hosts inside a Slurm allocation
(doctor_hosts.py): each line from the facts a host reports, then the doctor run for real on this
machine with a config (its probe launched as on any host, no ssh)."""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hvdtrain.job_config import load_config
from hvdtrain.model.build import build_model
from hvdtrain.tools import doctor_checks as checks
from hvdtrain.tools.doctor import Host
from hvdtrain.tools.doctor_hosts import extra_task, pick_hosts, slurm_hosts, srun_probe_command, tasks_per_node

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
VERSIONS = {package: "1.0" for _, package in checks.REQUIRED_MODULES}


def facts(**changes):
    base = {"built": {"nccl": False, "cuda": False, "gloo": True, "mpi": True}, "gpu_driver": False,
            "packages": dict(VERSIONS), "executable": "/opt/venv/bin/python"}
    return {**base, **changes}


# --- GPU operations without a driver ------------------------------------------------------------
def test_gpu_ops_without_a_driver_is_named_with_the_fix():
    nccl = {"nccl": True, "cuda": True, "gloo": True, "mpi": True}
    hosts = [Host("gpu0", 1, facts(built=nccl, gpu_driver=True)), Host("cpu0", 1, facts(built=nccl)),
             Host("cpu1", 1, facts())]
    assert checks.host_problems(hosts) == [
        "cpu0: Horovod was built with GPU operations (NCCL) but the host has no GPU driver (no libcuda.so.1, no "
        "/proc/driver/nvidia): hvd.join hangs under Gloo and fails under MPI; rebuild Horovod with CPU operations "
        "there (HVDTRAIN_GPU_OPS=none make setup) or use GPU hosts"]
    # A host of an older hvdtrain reports no driver fact: no guess.
    old = facts(built=nccl)
    del old["gpu_driver"]
    assert checks.host_problems([Host("old", 1, old)]) == []


def test_gpu_driver_is_found_as_make_setup_finds_it(monkeypatch):
    monkeypatch.setattr(checks.Path, "exists", lambda self: False)

    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert checks.gpu_driver() is False
    monkeypatch.setattr(ctypes, "CDLL", lambda name: object())  # a container: the library, no /proc entry
    assert checks.gpu_driver() is True
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    monkeypatch.setattr(checks.Path, "exists", lambda self: str(self) == "/proc/driver/nvidia/version")
    assert checks.gpu_driver() is True


# --- packages -----------------------------------------------------------------------------------
def test_a_package_a_host_cannot_import_or_has_in_another_version_names_the_host():
    missing = dict(VERSIONS, simplejpeg="missing: ModuleNotFoundError: No module named 'simplejpeg'")
    hosts = [Host("node0", 1, facts()), Host("node1", 1, facts(packages=missing)),
             Host("node2", 1, facts(packages=dict(VERSIONS, numpy="2.0")))]
    assert checks.host_problems(hosts) == [
        "node1: its Python (/opt/venv/bin/python) cannot import simplejpeg (ModuleNotFoundError: No module named "
        "'simplejpeg'): install it there (pip install simplejpeg, or make setup); every host needs the same "
        "environment",
        "node2: numpy 2.0 differs from node0's 1.0 (environments must match: install the same version on every host)"]
    assert checks.host_problems([Host("a", 1, facts()), Host("b", 1, facts())]) == []


def test_package_versions_of_this_python_and_one_that_fails_to_import(monkeypatch):
    here = checks.package_versions()
    assert set(here) == set(VERSIONS) and not any(v.startswith(checks.MISSING) for v in here.values()), here
    real_import = checks.importlib.import_module

    def broken(name, *args):
        if name == "simplejpeg":
            raise ImportError("libturbojpeg.so.0: cannot open shared object file")
        return real_import(name, *args)

    monkeypatch.setattr(checks.importlib, "import_module", broken)
    assert checks.package_versions()["simplejpeg"] == \
        "missing: ImportError: libturbojpeg.so.0: cannot open shared object file"


# --- folders -------------------------------------------------------------------------------------
def test_data_dir_missing_and_output_dir_not_writable_name_the_host(tmp_path, monkeypatch):
    data = tmp_path / "data"
    (data / "train" / "a").mkdir(parents=True)
    (data / "train" / "a" / "0.jpg").write_bytes(b"x" * 5000)
    here = checks.probe_facts(str(data), str(tmp_path / "runs" / "one"))
    assert here["data_dir"]["visible"] and here["data_dir"]["read"]["bytes"] == 5000
    assert here["output_dir"]["problem"] is None and here["output_dir"]["free"] > 0
    assert not (tmp_path / "runs").exists()  # the probe creates nothing
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    away = checks.probe_facts(str(tmp_path / "unmounted"), str(blocked / "runs"))
    hosts = [Host("node0", 1, facts(**here)), Host("node1", 1, facts(**away))]
    assert checks.host_problems(hosts) == [
        f"node1: data.dir '{tmp_path / 'unmounted'}' is not there (not mounted, or another path on this host): mount "
        f"it on every host at the same path, or copy the data there",
        f"node1: output.dir '{blocked}' is not a folder: set output.dir to a folder you can write to "
        f"(rank 0 writes it)"]
    # Root passes every permission check, so the mode case is shown with os.access answering no.
    monkeypatch.setattr(checks.os, "access", lambda path, mode: False)
    assert checks.writable_problem(tmp_path / "runs" / "x") == \
        f"'{tmp_path / 'runs' / 'x'}' would be made in '{tmp_path}', which is not writable by this user"


def test_read_speed_is_bounded_and_spread_over_classes(tmp_path):
    for cls in range(8):
        folder = tmp_path / "train" / f"class{cls}"
        folder.mkdir(parents=True)
        for index in range(20):
            (folder / f"{index}.jpg").write_bytes(os.urandom(64 * 1024))
    read = checks.read_speed(tmp_path, max_bytes=2 * 2**20, max_seconds=30)
    assert read["bytes"] == 2 * 2**20 and read["files"] == 32 and read["seconds"] > 0  # stops at the byte bound
    everything = checks.read_speed(tmp_path, max_bytes=2**30, max_seconds=30)
    assert everything["files"] == 160 and everything["bytes"] == 160 * 64 * 1024
    assert checks.read_speed(tmp_path, max_bytes=2**30, max_seconds=0)["files"] == 0  # the time bound
    listed = checks.data_files(tmp_path, limit=40)
    assert len(listed) == 40 and len({p.parent for p in listed}) == 2  # breadth-first: classes before files


def test_read_speed_lines_name_the_slow_host():
    def read(mb_per_s):
        return {"data_dir": {"path": "/data", "visible": True,
                             "read": {"bytes": 32e6, "files": 300, "seconds": 32 / mb_per_s}}}
    hosts = [Host("node0", 1, facts(**read(800))), Host("node1", 1, facts(**read(100))), Host("node2", 1, facts())]
    lines = checks.read_speed_lines(hosts)
    assert lines[0].endswith(": node0 800 MB/s, 7,500 files/s (300 files), node1 100 MB/s, 938 files/s (300 files)")
    assert lines[1].startswith("note: node1 read(s) the data folder at under half the fastest host's speed")
    assert checks.read_speed_lines([Host("node0", 1, facts())]) == []


# --- checkpoint size against free space ---------------------------------------------------------
@pytest.mark.parametrize("overrides, state_tensors", [(["optim.name=sgd"], 1), (["optim.name=adamw"], 2),
                                                      (["optim.name=sgd", "optim.momentum=0"], 0),
                                                      (["optim.name=sgd", "ema.decay=0.999"], 1)])
def test_checkpoint_estimate_matches_the_state_a_checkpoint_holds(overrides, state_tensors):
    cfg = load_config(None, ["model.arch=resnet18", "model.num_classes=10", *overrides])
    size, how = checks.checkpoint_estimate(cfg)
    model = build_model(cfg.model, 10)
    params = [p for p in model.parameters()]
    optimizer = (torch.optim.AdamW(params) if cfg.optim.name == "adamw" else
                 torch.optim.SGD(params, lr=0.1, momentum=cfg.optim.momentum))
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    optimizer.step()
    real = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if cfg.ema.decay > 0:
        real["ema"] = {k: v.clone() for k, v in model.state_dict().items()}
    held = sum(t.numel() * t.element_size() for part in real.values() for t in tensors(part))
    assert size == pytest.approx(held, rel=0.01), (size, held)
    assert how.startswith(f"resnet18: 11.2M parameters x 4 bytes x {1 + state_tensors + (cfg.ema.decay > 0)}")


def tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from tensors(item)


def test_disk_line_compares_free_space_with_the_checkpoints_held_at_once():
    estimate = (100 * 2**20, "resnet18: ...")
    def host(free):
        return Host("node0", 1, facts(output_dir={"path": "/runs/a", "problem": None, "free": free}))
    line, short = checks.disk_line([host(300 * 2**20)], estimate, keep=3)
    assert short and line == ("output.dir '/runs/a' has 300 MB free; the checkpoints need 432 MB (4 of about 100 MB "
                              "at once with checkpoint.keep=3; resnet18: ...): free space there, lower "
                              "checkpoint.keep, or set output.dir to another file system")
    line, short = checks.disk_line([host(10 * 2**30)], estimate, keep=3)
    assert not short and line.startswith("checkpoints: about 100 MB each (resnet18: ...); output.dir '/runs/a' has "
                                         "10,240 MB free for the 4 held at once")
    assert checks.disk_line([host(1)], None, keep=3) == (None, False)


# --- elastic on one host --------------------------------------------------------------------------
def test_elastic_on_one_host_without_an_interface_is_named():
    one = [Host("node0", 1, facts())]
    assert checks.elastic_problem(one, elastic=True, interfaces=None).startswith(
        "an elastic start on one host (node0) with no network interface named waits silently for the elastic "
        "timeout")
    assert checks.elastic_problem(one, elastic=True, interfaces="eth0") is None
    assert checks.elastic_problem(one * 2, elastic=True, interfaces=None) is None
    assert checks.elastic_problem(one, elastic=False, interfaces=None) is None


# --- Slurm ------------------------------------------------------------------------------------------
def test_tasks_per_node():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    assert tasks_per_node("odd") == []


def fake_scontrol(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu01\\ngpu02\\ngpu03\\n"\n')
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-03]",
            "SLURM_TASKS_PER_NODE": "4(x2),2"}


def test_inside_an_allocation_the_hosts_are_its_nodes_reached_with_srun(tmp_path, monkeypatch):
    env = fake_scontrol(tmp_path)
    assert slurm_hosts(env) == [("gpu01", 4), ("gpu02", 4), ("gpu03", 2)]
    assert slurm_hosts({k: v for k, v in env.items() if k != "SLURM_JOB_ID"}) is None
    assert slurm_hosts({**env, "SLURM_JOB_NODELIST": "node7", "PATH": "/nonexistent"}) == [("node7", 4)]
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = argparse.Namespace(hostfile=None, hosts=None, host_discovery_script=None)
    hosts = pick_hosts(args)
    assert [(h.name, h.slots) for h in hosts] == [("gpu01", 4), ("gpu02", 4), ("gpu03", 2)] and args.slurm
    assert srun_probe_command("gpu02", ["python", "-m", "hvdtrain", "doctor", "--probe"]) == [
        "srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=gpu02", "--kill-on-bad-exit=0",
        "python", "-m", "hvdtrain", "doctor", "--probe"]
    # -H still wins inside an allocation.
    args = argparse.Namespace(hostfile=None, hosts="a:1", host_discovery_script=None)
    assert [h.name for h in pick_hosts(args)] == ["a"] and not args.slurm


def test_one_doctor_per_srun_step():
    assert not extra_task({})
    assert not extra_task({"SLURM_STEP_ID": "0", "SLURM_PROCID": "0"})
    assert extra_task({"SLURM_STEP_ID": "0", "SLURM_PROCID": "3"})
    assert not extra_task({"SLURM_PROCID": "3"})  # a batch script's shell, not a step: no


def test_discovery_script_hosts_and_the_elastic_line(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho node0:2\n")
    script.chmod(0o755)
    args = argparse.Namespace(hostfile=None, hosts=None, host_discovery_script=str(script))
    assert [(h.name, h.slots) for h in pick_hosts(args)] == [("node0", 2)]


# --- the doctor for real, on this machine ---------------------------------------------------------
def run_doctor(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([str(PYTHON), "-m", "hvdtrain", "doctor", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, env={**clean, **(env or {})})


def test_the_doctor_checks_the_runs_folders_and_a_package_the_host_lacks(tmp_path, tiny_data):
    good = run_doctor(tmp_path, "-H", "localhost:1", "--skip-bench", "--config", "debug", f"data.dir={tiny_data}",
                      f"output.dir={tmp_path / 'run'}")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "checkpoints: about " in good.stdout and f"output.dir '{tmp_path / 'run'}' has " in good.stdout
    assert re.search(r"^data folder read speed \(up to 32 MB or 5 s per host, page cache dropped where allowed\): "
                     r"localhost \d+ MB/s, [\d,]+ files/s \(11\d files\)$", good.stdout, re.M), good.stdout
    # A data folder that is not there: test_data_dir_missing_and_output_dir_not_writable_name_the_host.
    # A simplejpeg of the user's on PYTHONPATH that hides the installed one and cannot be imported
    # (the probe's own import; the doctor itself reads no config and needs none of it): the doctor
    # names the file that shadows it and the fix. A package missing on a host: the test above.
    broken = tmp_path / "broken"
    (broken / "simplejpeg").mkdir(parents=True)
    (broken / "simplejpeg" / "__init__.py").write_text("raise ImportError('libturbojpeg.so.0: cannot open')\n")
    bad = run_doctor(tmp_path, "-H", "localhost:1", "--skip-bench", env={"PYTHONPATH": str(broken)})
    assert bad.returncode == 1, bad.stdout + bad.stderr
    python = f"python{sys.version_info.major}.{sys.version_info.minor}"
    installed = Path(PYTHON).parent.parent / "lib" / python / "site-packages" / "simplejpeg"
    assert bad.stderr.splitlines() == [
        f"hvdtrain doctor: localhost: module 'simplejpeg' is shadowed by {broken / 'simplejpeg' / '__init__.py'} (on "
        f"PYTHONPATH), which hides the installed {installed}: rename it, or take {broken} off PYTHONPATH"], bad.stderr


def test_the_doctors_trap_lines_for_a_one_host_discovery_script_and_a_config(tmp_path, capsys):
    from hvdtrain.tools.doctor import trap_lines

    host = Host("node0", 1, facts(output_dir={"path": str(tmp_path), "problem": None, "free": 2**20}))
    args = argparse.Namespace(host_discovery_script="discover.sh", cfg=None, network_interfaces=None)
    assert [line[:40] for line in trap_lines([host], args)] == ["an elastic start on one host (node0) wit"]
    args = argparse.Namespace(host_discovery_script=None, network_interfaces=None,
                              cfg=load_config(None, ["elastic.enabled=true", "model.num_classes=10"]))
    problems = trap_lines([host], args)  # elastic in the config, and 1 MB free for ResNet-50's checkpoints
    assert problems[0].startswith("an elastic start on one host (node0)")
    assert problems[1].startswith(f"output.dir '{tmp_path}' has 1 MB free; the checkpoints need ")
    assert len(problems) == 2 and capsys.readouterr().out == ""
