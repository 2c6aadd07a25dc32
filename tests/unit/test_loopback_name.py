"""A host name on a loopback address matters only across hosts, and only where no interface is named."""

from __future__ import annotations

import socket

import pytest

from hvdtrain.comm import launcher_env as launcher

MULTI_HOST = {"HOROVOD_SIZE": "2", "HOROVOD_CROSS_SIZE": "2"}


@pytest.fixture
def loopback_name(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu07")
    real = socket.getaddrinfo
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))] if host == "gpu07" else real(host, *a, **k))
    for name in ("HOROVOD_CROSS_SIZE", "HOROVOD_SIZE", "HOROVOD_LOCAL_SIZE", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_JOB_NUM_NODES", "SLURM_NNODES",
                 "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_RENDEZVOUS_ADDR", "MASTER_ADDR",
                 "HOROVOD_HOSTNAME"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("env, spans", [
    ({"HOROVOD_CROSS_SIZE": "2"}, True), ({"HOROVOD_CROSS_SIZE": "1", "WORLD_SIZE": "4"}, False),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}, True), ({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, False),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, True), ({"SLURM_JOB_NUM_NODES": "3"}, True),
    ({}, False),
    # The launcher's sizes before the allocation's node count: torchrun on one node of two.
    ({"SLURM_JOB_NUM_NODES": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, False),
    # Slurm's node count from either variable; a value that is no number says nothing.
    ({"SLURM_JOB_NUM_NODES": "1", "SLURM_NNODES": "2"}, True), ({"HOROVOD_CROSS_SIZE": "x", "SLURM_NNODES": "2"}, True),
])
def test_spans_hosts_reads_each_launcher(loopback_name, monkeypatch, env, spans):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert launcher.spans_hosts() is spans


def test_the_line_names_host_address_and_fix_across_hosts_only(loopback_name, monkeypatch):
    assert launcher.loopback_name_problem("GLOO_SOCKET_IFNAME", "export GLOO_SOCKET_IFNAME={iface}") is None
    for key, value in MULTI_HOST.items():
        monkeypatch.setenv(key, value)
    line = launcher.loopback_name_problem("GLOO_SOCKET_IFNAME", "export GLOO_SOCKET_IFNAME={iface}")
    assert line.startswith("this host's name 'gpu07' resolves to the loopback address 127.0.1.1 (/etc/hosts)")
    assert "Debian's '127.0.1.1 gpu07'" in line and "export GLOO_SOCKET_IFNAME=" in line and "{iface}" not in line
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "127.0.0.2")  # hosts on loopback: one machine
    assert launcher.loopback_name_problem() is None
    monkeypatch.setenv("HOROVOD_GLOO_RENDEZVOUS_ADDR", "198.18.0.1")
    assert launcher.loopback_name_problem() is not None
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # torch's Gloo binds there, not to the name
    assert launcher.loopback_name_problem("GLOO_SOCKET_IFNAME", "") is None
    monkeypatch.setenv("HOROVOD_GLOO_IFACE", "eth0")  # Horovod's Gloo still advertises the name's address
    assert launcher.loopback_name_problem().endswith("(in place of a line like Debian's '127.0.1.1 gpu07')")


def test_horovodruns_host_name_is_checked_and_rays_loopback_ip_is_a_node_here(loopback_name, monkeypatch):
    """horovodrun -H gpu07:1,... exports HOROVOD_HOSTNAME=gpu07: that name resolving to loopback is
    the very problem, never a sign the job is on one machine (the netns test caught the check
    skipping it). hvdtrain ray names nodes by IP: 127.0.0.1 there is a node on this machine."""
    for key, value in {**MULTI_HOST, "HOROVOD_GLOO_RENDEZVOUS_ADDR": "198.18.0.1:4000/token"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HOROVOD_HOSTNAME", "gpu07")
    assert launcher.loopback_name_problem() is not None
    monkeypatch.setenv("HOROVOD_HOSTNAME", "127.0.0.1")
    assert launcher.loopback_name_problem() is None


def test_a_name_on_a_network_address_is_fine(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "gpu07")
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: [(socket.AF_INET, 1, 6, "", ("198.18.0.2", 0))])
    for key, value in MULTI_HOST.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert launcher.name_loopback_address() is None
    assert launcher.loopback_name_problem("GLOO_SOCKET_IFNAME", "") is None
