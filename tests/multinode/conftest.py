"""Fixtures for multi-machine tests: ``two_nodes`` (node0/node1 over real ssh on loopback, see nodes.py)
and ``net_nodes`` (node0/node1 in network namespaces over a rate-limited link, see netns.py)."""

from __future__ import annotations

import pytest

from tests.conftest import session_dir

from .nodes import TwoNodes, unavailable_reason

NET_RATE = "250mbit"  # the net_nodes link: slow enough that a 2-node step waits on it


@pytest.fixture(scope="session")
def two_nodes(tmp_path_factory) -> TwoNodes:
    """Two ssh-reachable machines, node0 and node1, for the whole session (see nodes.TwoNodes).

    Skips, with the reason, where the harness cannot run (not root, no sshd).
    """
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    nodes = TwoNodes(session_dir(tmp_path_factory, "two_nodes"))
    nodes.start()
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="session")
def net_nodes(tmp_path_factory):
    """node0 and node1 in network namespaces joined by a 250 Mbit/s link (see netns.NetNodes), for the
    whole session. Skips, with the reason, where it cannot run (not root, no ``ip netns``, no tbf)."""
    from .netns import NetNodes
    from .netns import unavailable_reason as netns_unavailable

    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)
    nodes = NetNodes(session_dir(tmp_path_factory, "net_nodes")).start(rate=NET_RATE)
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A running one-machine Slurm cluster (see slurm.SlurmCluster); skips with the reason where
    Slurm cannot run (not root, slurm-wlm/munge not installed)."""
    from .slurm import SlurmCluster
    from .slurm import unavailable_reason as slurm_unavailable

    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster(session_dir(tmp_path_factory, "slurm")).start()
    try:
        yield cluster
    finally:
        cluster.stop()
