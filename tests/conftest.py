"""Shared fixtures: a tiny generated dataset. Plain helpers (``launch``, ``PROBE``, ...) are in
tests/helpers.py."""

from __future__ import annotations

import importlib
import os
import shutil
from pathlib import Path

import pytest

# tests/image builds and runs the docker image (about 15 minutes): only `make test-image` runs it.
collect_ignore = [] if os.environ.get("HVDTRAIN_TEST_IMAGE") else ["image"]


def pytest_collection_modifyitems(config, items):
    """The tiers of pytest.ini, by where a test lives (``slurm``: by the cluster it asks for, since a
    unit test of a batch script needs no Slurm): ``pytest -m "not slurm"`` and the like; and the
    groups pytest-xdist keeps on one worker (``make test``: ``-n 2 --dist loadgroup``)."""
    for item in items:
        path = Path(str(item.fspath))
        folder = path.parent.name
        if folder == "parallel":
            item.add_marker("launched")
        if folder == "multinode":
            item.add_marker("multinode")
        if folder == "image":
            item.add_marker("image")
        if "slurm_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker("slurm")
        if path.stem == "test_ray":
            item.add_marker("ray")
        group_for_xdist(config, item, "machine" if folder == "multinode" else item.nodeid.split("::")[0])
        give_a_deadline(config, item, folder)


# Each test's deadline in seconds, by tier: the last guard against a hang, far above the slowest test
# of its tier (about 100 s for a Slurm requeue, 85 s for a launched test, on a quiet 2-core machine;
# CI's machines are up to 2.4 times slower). A test's own ``@pytest.mark.timeout(N)`` wins.
DEADLINES = {"unit": 300, "parallel": 900, "shared_ranks": 900, "multinode": 1800, "image": 3600}


def give_a_deadline(config, item, folder: str) -> None:
    """pytest-timeout's mark for ``item`` (fixture set-up included), where the plugin is installed."""
    if config.pluginmanager.hasplugin("timeout") and item.get_closest_marker("timeout") is None:
        item.add_marker(pytest.mark.timeout(DEADLINES.get(folder, 300)))


def group_for_xdist(config, item, group: str) -> None:
    """Keep ``item`` on the pytest-xdist worker of ``group``: a test file's tests together, so that
    its module fixtures (an uninterrupted run, a server on a fixed port, a Ray cluster) are made
    once; every test of tests/multinode together, since they share this machine's sshd, /etc/hosts,
    ~/.ssh/config and its Slurm cluster (and hold its lock for the session).

    pytest-xdist's loadgroup reads the group from a ``@group`` suffix of the test's node id. Its own
    hook (for ``xdist_group`` marks) writes the suffix to ``item._nodeid``, which pytest 9 no longer
    reads (the id lives in ``item._id``), so every test would be a group of its own: the suffix is
    written here, where pytest 9 reads it."""
    item.add_marker(pytest.mark.xdist_group(group))
    if getattr(config.option, "loadgroup", False) and "@" not in item.nodeid:
        from _pytest.nodeid import coerce_node_id
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """4 classes x 24 training images; 21 validation images (an odd count: uneven shards)."""
    import numpy as np

    from hvdtrain.data.demo import draw, generate

    root = session_dir(tmp_path_factory, "tiny_data")
    generate(root, train_per_class=24, val_per_class=5, size=40, num_classes=4)
    extra = root / "val" / "horizontal_0" / "extra.JPEG"
    draw(0, 40, np.random.default_rng(99)).save(extra, quality=90)
    return root


_SESSION_DIRS: set[Path] = set()  # what session-scoped fixtures (tiny_data, the nodes) made: kept


def session_dir(tmp_path_factory, name: str) -> Path:
    """A folder for a session-scoped fixture, kept until the session ends whichever module first asked
    for the fixture (the module clean-up below spares it; the hook's record alone missed the Slurm
    cluster's folder once, and every later Slurm test failed)."""
    path = tmp_path_factory.mktemp(name)
    _SESSION_DIRS.add(path)
    return path


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    if fixturedef.scope != "session":
        return (yield)
    base = request.config._tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    try:
        return (yield)
    finally:
        _SESSION_DIRS.update(set(base.iterdir()) - before)


@pytest.fixture
def umask_022():
    """The umask most accounts have, so that a mode a test reads is the code's choice, not 077's."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.fixture
def victim_scratch():
    """A 1777 scratch folder with the second Unix user (tests/users.py) made, and the victim's home
    in it: (folder, home). Skips where no second user can be made."""
    from tests import users

    if users.why_not():
        pytest.skip(users.why_not())
    users.user()
    folder = users.scratch()
    yield folder, users.victim_home(folder)
    shutil.rmtree(folder)


@pytest.fixture(autouse=True)
def _restore_environment():
    """Give every test the environment the one before it started with. Code under test sets
    variables for the ranks it would start (the stall inspector's, Gloo's timeout); left in this
    process, a later test's launched job would read them as the user's own exports."""
    before = dict(os.environ)
    yield
    if os.environ != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(scope="module", autouse=True)
def _remove_module_outputs(tmp_path_factory):
    """Delete what a module's shared fixtures wrote (their uninterrupted runs, servers' stores) once
    the module is done. A failed test's own tmp_path (named after the test) is kept for debugging;
    pytest.ini drops the passing ones."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    for path in set(base.iterdir()) - before - _SESSION_DIRS:
        if not path.name.startswith("test_") and path.resolve() not in _SESSION_DIRS:
            shutil.rmtree(path, ignore_errors=True)


def pytest_sessionfinish(session):
    from tests import shared_ranks

    lines = shared_ranks.stop_all()
    worker_output = getattr(session.config, "workeroutput", None)  # a pytest-xdist worker's, for the controller
    if worker_output is not None:
        worker_output["shared_ranks_summary"] = lines
    summary = session.config.__dict__.setdefault("_shared_ranks_summary", [])
    summary += lines


def pytest_configure(config):
    if os.environ.get("HVDTRAIN_REQUIRE_EXTRAS") == "1":
        pytest.importorskip = import_or_fail
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(WorkerSummaries(), "shared_ranks_summaries")


def import_or_fail(modname: str, minversion: str | None = None, reason: str | None = None, **kwargs):
    """``pytest.importorskip`` where every extra must be there (``HVDTRAIN_REQUIRE_EXTRAS=1``, which
    .ci/run sets: CI installs the test extra, so a test skipped for a missing package would hide a
    broken install): the missing package fails the module instead of skipping it."""
    try:
        module = importlib.import_module(modname)
    except ImportError as error:
        pytest.fail(f"{modname} is required (HVDTRAIN_REQUIRE_EXTRAS=1) but does not import: {reason or error}",
                    pytrace=False)
    if minversion is not None:
        from packaging.version import Version
        if Version(getattr(module, "__version__", "0")) < Version(minversion):
            pytest.fail(f"{modname} {minversion} or newer is required (HVDTRAIN_REQUIRE_EXTRAS=1)", pytrace=False)
    return module


class WorkerSummaries:
    """The shared ranks' summary lines of each pytest-xdist worker, brought to the controller."""

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error):
        lines = getattr(node, "workeroutput", {}).get("shared_ranks_summary", [])
        worker = node.gateway.id
        node.config.__dict__.setdefault("_shared_ranks_summary", []).extend(f"{worker}: {line}" for line in lines)


TIERS = ("launched", "multinode", "slurm", "ray", "slow", "timing")
_seconds: dict[str, dict[str, float]] = {"folder": {}, "tier": {}}


def pytest_runtest_logreport(report):
    """Add each test's set-up, call and tear-down seconds to its folder and its tiers (in the
    pytest-xdist controller too, which receives every worker's reports)."""
    parts = report.nodeid.split("::")[0].split("/")
    folder = "/".join(parts[:2]) if len(parts) > 2 else parts[0]
    _seconds["folder"][folder] = _seconds["folder"].get(folder, 0.0) + report.duration
    for tier in TIERS:
        if tier in report.keywords:
            _seconds["tier"][tier] = _seconds["tier"].get(tier, 0.0) + report.duration


def seconds_lines() -> list[str]:
    """Where the suite's time went: test seconds per folder and per tier (summed over the workers, so
    more than the wall time when two ran at once; a test counts in each of its tiers)."""
    def line(kind: str) -> str:
        found = sorted(_seconds[kind].items(), key=lambda item: -item[1])
        return f"seconds per {kind}: " + ", ".join(f"{name} {seconds:,.0f}" for name, seconds in found)
    return [line(kind) for kind in ("folder", "tier") if _seconds[kind]]


def pytest_terminal_summary(terminalreporter, config):
    for line in getattr(config, "_shared_ranks_summary", []):
        terminalreporter.write_line(line)
    if not hasattr(config, "workerinput"):
        for line in seconds_lines():
            terminalreporter.write_line(line)
