"""The ports the tests, the benches and the development stack choose for
their servers (``lmsp_project.devstack.free_port``), and the environment of
the processes it starts (``run_environment``)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lmsp_project import devstack
from lmsp_project.devstack import free_port


def test_a_free_port_is_outside_the_range_the_kernel_hands_out_on_bind_zero() -> None:
    """Another process binding port 0 (vLLM's worker, in CI) cannot be given
    a port chosen here before our server binds it."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        assert low <= other.getsockname()[1] <= high
    for port in {free_port() for _ in range(20)}:
        assert 1024 <= port < low
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # free indeed


def test_a_host_whose_range_starts_at_1024_still_gets_a_free_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Nothing lies below such a range: the kernel's own choice, not a crash."""
    monkeypatch.setattr(devstack, "bind_zero_range_start", lambda: 1024)
    port = free_port()
    assert port >= 1024
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))  # free indeed


def test_the_processes_of_a_run_cache_their_bytecode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that turns bytecode caching off would have every process of the
    service and the tests compile torch and transformers at each start."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = devstack.run_environment({"REDIS_URL": "redis://127.0.0.1:1/0"})
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["REDIS_URL"] == "redis://127.0.0.1:1/0" and env["LMSP_DEVELOPMENT"] == "1"
