"""The traps ``hvdtrain doctor`` names, each in one line with its fix.

Each of these cost users hours, and each passed the doctor's version table:

- Horovod built with GPU operations on a host without a GPU driver: ``hvd.join`` hangs under
  Gloo and fails under MPI ("Could not dlopen libcuda.so").
- An elastic start with one host and no network interface named: horovodrun's elastic driver
  waits silently for a second host until the elastic timeout.
- A host whose Python cannot import a package hvdtrain needs (simplejpeg, say), or has another
  version of one than the first host: training then fails there with a traceback and no host name.
- ``data.dir`` not visible on a host; the output folder not writable; not enough free space there
  for the checkpoints the config will produce (from the model's parameter, buffer and optimizer
  bytes); and how fast each host reads the data folder (a few MB, bounded in time).

The first half runs on every host inside ``doctor --probe`` (``probe_facts``), the second on the
doctor's own machine over the facts that came back. Nothing here waits without a bound: the
probe's reads stop after ``READ_SECONDS`` or ``READ_BYTES``, and the probe itself has the doctor's
deadline.
"""

from __future__ import annotations

import ctypes
import importlib
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from .. import environment
from ..ownership import folder_problem

# What a training rank imports besides torch and Horovod (pyproject.toml's dependencies): module,
# the package that installs it.
REQUIRED_MODULES = (("torchvision", "torchvision"), ("numpy", "numpy"), ("PIL", "pillow"),
                    ("simplejpeg", "simplejpeg"), ("yaml", "pyyaml"), ("tensorboardX", "tensorboardX"),
                    ("tqdm", "tqdm"), ("psutil", "psutil"))
MISSING = "missing: "
SHADOWED = "shadowed: "
READ_BYTES = 32 * 2**20    # the data folder's read test stops after this many bytes ...
READ_SECONDS = 5.0         # ... or this many seconds
READ_FILES_LISTED = 2000   # ... over at most this many files, the first found
SLOW_READ_SHARE = 0.5      # a host reading at under half the fastest host's speed is named
# Optimizer state per parameter, in parameter-sized tensors (momentum; Adam's two moments).
OPTIMIZER_STATE = {"sgd": 1, "lars": 1, "adagrad": 1, "adam": 2, "adamw": 2, "lamb": 2}
CHECKPOINT_MARGIN_BYTES = 32 * 2**20  # checkpoint.MARGIN_BYTES: the file system's own needs, the logs


# --- on each host: the probe ------------------------------------------------------------------
def gpu_driver() -> bool:
    """Whether this host has a GPU driver, as make setup decides it (scripts/setup.sh): the kernel
    module answers, or the dynamic loader finds libcuda.so.1 (containers get only the library)."""
    if Path("/proc/driver/nvidia/version").exists():
        return True
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def package_versions() -> dict[str, str]:
    """Each package a rank imports -> its version, or ``missing: <why>`` where the import fails, or
    ``shadowed: <line>`` where a module of the user's hides the installed one (training says the
    same line: environment.py)."""
    found = {}
    folders = environment.install_folders()
    for module, package in REQUIRED_MODULES:
        hidden = environment.shadowed(module, folders=folders)
        if hidden:
            found[package] = f"{SHADOWED}{hidden}"
            continue
        try:
            imported = importlib.import_module(module)
        except Exception as error:  # an ImportError, or a broken build's OSError: the host's problem, named
            first_line = str(error).splitlines()[0][:120] if str(error) else ""
            found[package] = f"{MISSING}{type(error).__name__}: {first_line}"
            continue
        found[package] = str(getattr(imported, "__version__", "") or "?")
    return found


def writable_problem(path: Path) -> str | None:
    """Why this user cannot, or should not, write ``path`` (made on demand: its nearest existing parent
    must be writable; the ownership rule of training's run folder), or None. Creates nothing."""
    probe = path.absolute()
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"'{probe}' is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"'{probe}' is not writable by this user" if probe == path.absolute() else \
            f"'{path}' would be made in '{probe}', which is not writable by this user"
    return folder_problem(path)  # another user's folder, or one others can write or swap (hvdtrain/ownership.py)


def data_files(root: Path, limit: int = READ_FILES_LISTED) -> list[Path]:
    """Up to ``limit`` regular files under ``root``, in a stable order, walking folders breadth-first
    so that a few files of many classes are found before all files of the first one."""
    found, folders = [], [root]
    while folders and len(found) < limit:
        folder = folders.pop(0)
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                folders.append(Path(entry.path))
            elif entry.is_file() and len(found) < limit:
                found.append(Path(entry.path))
    return found


def read_speed(root: Path, max_bytes: int = READ_BYTES, max_seconds: float = READ_SECONDS) -> dict[str, float]:
    """Read files under ``root`` until ``max_bytes`` or ``max_seconds``: bytes, files and seconds.

    Each file is dropped from the page cache first where the kernel allows (posix_fadvise), so a
    second doctor run measures the file system again, not memory (on NFS the client may still cache)."""
    files = data_files(root)
    # Spread over the list: files of several classes, not the first folder's only.
    stride = max(1, len(files) // 64)
    order = files[::stride] + [f for i, f in enumerate(files) if i % stride]
    total, count, start = 0, 0, time.monotonic()
    for path in order:
        if total >= max_bytes or time.monotonic() - start >= max_seconds:
            break
        try:
            with open(path, "rb", buffering=0) as handle:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
                while chunk := handle.read(1 << 20):
                    total += len(chunk)
        except OSError:
            continue
        count += 1
    return {"bytes": total, "files": count, "seconds": max(time.monotonic() - start, 1e-6)}


def gloo_launcher_hides_env() -> bool:
    """Whether this Horovod's ``horovodrun --gloo`` keeps the environment's values out of the
    ranks' command lines (third_party/horovod/0006). A stock Horovod 0.28.1 starts every
    rank as ``sh -c 'env K=V ... python ...'`` with the whole environment, API keys included."""
    try:
        from horovod.runner import gloo_run
    except ImportError:
        return True  # no horovodrun: nothing to expose
    return hasattr(gloo_run, "rank_env_vars")


# (secrets_note runs on the doctor's machine; it lives here with the probe fact it reads)
def secrets_note(hosts: Sequence[Any]) -> str | None:
    """One line naming the hosts whose horovodrun --gloo would show secrets to every user, or None."""
    exposed = [h.name for h in hosts if h.facts and not h.facts.get("gloo_hides_env", True)]
    if not exposed:
        return None
    return (f"note: {', '.join(exposed)}: this Horovod's horovodrun --gloo puts every environment value (API keys, "
            f"passwords) in the ranks' command lines, which any user of the host reads with ps: install Horovod "
            f"with hvdtrain's patch (make setup), or launch with mpirun -x NAME or srun (docs/launching.md)")



def probe_facts(data_dir: str | None, output_dir: str | None) -> dict[str, Any]:
    """The trap-related facts of this host, for ``doctor --probe`` (``local_facts`` adds them)."""
    facts: dict[str, Any] = {"gpu_driver": gpu_driver(), "packages": package_versions()}
    if data_dir and "://" not in data_dir:
        root = Path(data_dir)
        facts["data_dir"] = {"path": str(root.absolute()), "visible": root.is_dir()}
        if root.is_dir():
            from ..data.files.index import unreadable_problem

            facts["data_dir"]["unreadable"] = unreadable_problem(root, tuple(s for s in ("train", "val")
                                                                               if (root / s).is_dir()))
            facts["data_dir"]["read"] = read_speed(root)
    if output_dir:
        path = Path(output_dir)
        problem = writable_problem(path)
        existing = next(p for p in [path.absolute(), *path.absolute().parents] if p.exists())
        facts["output_dir"] = {"path": str(path.absolute()), "problem": problem,
                               "free": shutil.disk_usage(existing).free if existing.is_dir() else 0}
    return facts


# --- on the doctor's machine: the lines ---------------------------------------------------------
def gpu_ops_problem(name: str, facts: Mapping[str, Any]) -> str | None:
    built = facts.get("built", {})
    if (built.get("nccl") or built.get("cuda")) and "gpu_driver" in facts and not facts["gpu_driver"]:
        return (f"{name}: Horovod was built with GPU operations (NCCL) but the host has no GPU driver (no "
                f"libcuda.so.1, no /proc/driver/nvidia): hvd.join hangs under Gloo and fails under MPI; rebuild "
                f"Horovod with CPU operations there (HVDTRAIN_GPU_OPS=none make setup) or use GPU hosts")
    return None


def package_problems(hosts: Sequence[Any]) -> list[str]:
    """A host that cannot import a package, or has another version of it than the first host."""
    problems = []
    reachable = [h for h in hosts if h.facts.get("packages")]
    reference = reachable[0] if reachable else None
    for host in reachable:
        for package, version in host.facts["packages"].items():
            if version.startswith(SHADOWED):
                problems.append(f"{host.name}: {version[len(SHADOWED):]}")
                continue
            if version.startswith(MISSING):
                problems.append(f"{host.name}: its Python ({host.facts.get('executable', 'python')}) cannot import "
                                f"{package} ({version[len(MISSING):]}): install it there (pip install {package}, or "
                                f"make setup); every host needs the same environment")
                continue
            theirs = reference.facts["packages"].get(package, "")
            if host is not reference and not theirs.startswith((MISSING, SHADOWED)) and version != theirs:
                problems.append(f"{host.name}: {package} {version} differs from {reference.name}'s {theirs} "
                                f"(environments must match: install the same version on every host)")
    return problems


def folder_problems(hosts: Sequence[Any]) -> list[str]:
    problems = []
    for host in hosts:
        data = host.facts.get("data_dir")
        if data and not data["visible"]:
            problems.append(f"{host.name}: data.dir '{data['path']}' is not there (not mounted, or another path on "
                            f"this host): mount it on every host at the same path, or copy the data there")
        elif data and data.get("unreadable"):
            problems.append(f"{host.name}: {data['unreadable']}")
        output = host.facts.get("output_dir")
        if output and output.get("problem"):
            problems.append(f"{host.name}: output.dir {output['problem']}: set output.dir to a folder you can "
                            f"write to (rank 0 writes it)")
    return problems


def host_problems(hosts: Sequence[Any]) -> list[str]:
    """Every trap found in the hosts' facts, one line each, naming the host and the fix."""
    reachable = [h for h in hosts if h.facts]
    problems = [p for h in reachable if (p := gpu_ops_problem(h.name, h.facts))]
    return problems + package_problems(reachable) + folder_problems(reachable)


def elastic_problem(hosts: Sequence[Any], elastic: bool, interfaces: str | None) -> str | None:
    """One host, elastic, no interface named: horovodrun's elastic driver waits for a second host
    (launch.one_host_elastic, which ``hvdtrain launch`` applies itself)."""
    if not elastic or interfaces or len(hosts) != 1:
        return None
    return (f"an elastic start on one host ({hosts[0].name}) with no network interface named waits silently for "
            f"the elastic timeout (horovodrun's driver wants a second host): launch with hvdtrain launch (it names "
            f"lo for this host) or add --network-interfaces NIC to horovodrun")


def optimizer_state_tensors(cfg: Any) -> int:
    if cfg.optim.name == "sgd" and cfg.optim.momentum == 0:
        return 0
    return OPTIMIZER_STATE.get(cfg.optim.name, 2)


def checkpoint_estimate(cfg: Any) -> tuple[int, str] | None:
    """(bytes, how they were counted) of one checkpoint of ``cfg``'s model: parameters and buffers,
    the optimizer's state, the EMA copy; the model is built on the meta device (no memory, no data
    read). None where the task's model needs its data to be built (the recommender's id counts)."""
    if cfg.task != "image_classification":
        return None
    import torch

    from ..model.build import build_model

    num_classes = cfg.model.num_classes or class_count(cfg) or 1000
    with torch.device("meta"):
        model = build_model(cfg.model, num_classes)
    dtype_bytes = torch.empty((), dtype=getattr(torch, cfg.model.dtype)).element_size()
    params = sum(p.numel() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    state = optimizer_state_tensors(cfg)
    copies = 1 + state + (1 if cfg.ema.decay > 0 else 0)
    total = params * dtype_bytes * copies + buffers * (2 if cfg.ema.decay > 0 else 1)
    return total, (f"{cfg.model.arch}: {params / 1e6:.1f}M parameters x {dtype_bytes} bytes x {copies} "
                   f"(weights, {state} optimizer state{'s' if state != 1 else ''} of {cfg.optim.name}"
                   + (", EMA" if cfg.ema.decay > 0 else "") + ")")


def class_count(cfg: Any) -> int:
    train = Path(cfg.data.dir) / "train" if cfg.data.dir and "://" not in cfg.data.dir else None
    try:
        return sum(1 for entry in os.scandir(train) if entry.is_dir()) if train and train.is_dir() else 0
    except OSError:
        return 0


def megabytes(count: float) -> str:
    return f"{count / 2**20:,.0f} MB"


def disk_line(hosts: Sequence[Any], estimate: tuple[int, str] | None, keep: int) -> tuple[str | None, bool]:
    """(the line about the output folder's free space against the checkpoints, whether it is a
    problem). At most ``keep`` numbered files plus the one being written are on disk at once
    (last.pt and best.pt are hard links to them)."""
    if estimate is None:
        return None, False
    size, how = estimate
    held = max(1, keep) + 1
    needed = size * held + CHECKPOINT_MARGIN_BYTES
    # Rank 0 writes the checkpoints: the first host's view of the folder is the one that counts.
    output = next((h.facts["output_dir"] for h in hosts if h.facts.get("output_dir")), None)
    if output is None:
        return None, False
    free = output["free"]
    if free < needed:
        return (f"output.dir '{output['path']}' has {megabytes(free)} free; the checkpoints need {megabytes(needed)} "
                f"({held} of about {megabytes(size)} at once with checkpoint.keep={keep}; {how}): free space "
                f"there, lower checkpoint.keep, or set output.dir to another file system"), True
    return (f"checkpoints: about {megabytes(size)} each ({how}); output.dir '{output['path']}' has "
            f"{megabytes(free)} free for the {held} held at once (checkpoint.keep={keep}): enough"), False


def read_speed_lines(hosts: Sequence[Any]) -> list[str]:
    """Each host's read speed of the data folder, and the hosts much slower than the fastest."""
    speeds = {}
    for host in hosts:
        read = (host.facts.get("data_dir") or {}).get("read")
        if read and read["files"]:
            speeds[host.name] = (read["bytes"] / read["seconds"], read)
    if not speeds:
        return []
    lines = ["data folder read speed (up to {} MB or {:g} s per host, page cache dropped where allowed): ".format(
        READ_BYTES >> 20, READ_SECONDS) + ", ".join(
        f"{name} {rate / 1e6:.0f} MB/s, {read['files'] / read['seconds']:,.0f} files/s ({read['files']} files)"
        for name, (rate, read) in speeds.items())]
    fastest = max(rate for rate, _ in speeds.values())
    slow = [name for name, (rate, _) in speeds.items() if rate < SLOW_READ_SHARE * fastest]
    if slow:
        lines.append(f"note: {', '.join(slow)} read(s) the data folder at under half the fastest host's speed: "
                     f"its ranks may wait for data; copy the data to local disk there (or raise data.workers)")
    return lines
