"""Where the embedded PostgreSQL and Redis of ``scripts/serve`` are, for the
other commands of this checkout.

``scripts/serve`` (``devstack serve``) starts them when ``DATABASE_URL`` /
``REDIS_URL`` are unset and records their addresses in the data folder
(``services.json``, removed when it stops). Settings read that record when
the variables are unset, so ``manage.py ...`` or a second
``python -m workers.serve`` beside a running ``scripts/serve`` reach the same
servers without the user exporting anything. With the service stopped,
``manage.py`` starts the embedded PostgreSQL itself for the length of the
command (``attach_embedded_postgres``).

Only the standard library at import time: settings import this module.
"""

from __future__ import annotations

import atexit
import json
import os
from pathlib import Path
from typing import Any

RECORD_NAME = "services.json"
DATABASE_NAME = "lmsp"
# manage.py commands that never open a database connection: no PostgreSQL for them.
NO_DATABASE_COMMANDS = frozenset(
    {"help", "--help", "-h", "version", "--version", "lmsp_prepare_models", "makemigrations"}
)


def data_dir() -> Path:
    root = Path(__file__).resolve().parent.parent
    return Path(os.environ.get("LMSP_DATA_DIR", root / ".data"))


def _started_at(pid: int) -> float | None:
    """When process ``pid`` started (Unix time, to a second), where Linux
    tells (``/proc``); None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(
            line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime")
        )
    except (OSError, StopIteration):
        return None
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


def _wrote(pid: int, path: Path) -> bool:
    """Whether process ``pid`` may have written ``path``: it is alive and
    started before the file was last written (a process that started later
    has only been given the pid of the one that wrote it, which died)."""
    if not _alive(pid):
        return False
    started = _started_at(pid)
    return started is None or started <= path.stat().st_mtime + 1  # btime is to a second


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def record(folder: Path, urls: dict[str, str]) -> Path:
    """Write the addresses of the services this process started (and its pid)."""
    path = folder / RECORD_NAME
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({**urls, "pid": os.getpid()}))
    tmp.replace(path)
    return path


def forget(folder: Path) -> None:
    """Remove the record, if it is this process's."""
    path = folder / RECORD_NAME
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


RECORDED = ("DATABASE_URL", "REDIS_URL", "LMSP_DEVELOPMENT")


def recorded(folder: Path | None = None) -> dict[str, str]:
    """``DATABASE_URL`` / ``REDIS_URL`` of a running ``scripts/serve`` of this
    checkout, and ``LMSP_DEVELOPMENT`` (its embedded services make it a
    development run), or nothing when none runs (a record left by a killed
    one is ignored, even when its pid now names another process)."""
    path = (folder or data_dir()) / RECORD_NAME
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or not _wrote(int(data.get("pid", 0)), path):
            return {}
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if k in RECORDED and v}


def _forget_dead_handles(pgdata: Path) -> None:
    """pgserver stops its server when the last process holding it exits, and
    counts holders in a file; a holder killed outright stays in it forever and
    the server would never stop. Drop the dead ones."""
    path = pgdata / ".handle_pids.json"
    try:
        pids = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    alive = [pid for pid in pids if _alive(pid)]
    if alive != pids:
        path.write_text(json.dumps(alive))


def _follow_restarts(server: Any) -> None:  # a pgserver.PostgresServer
    """pgserver's exit hook stops the server through the postmaster process it
    saw when it attached; after a restart with ``pg_ctl`` (the PostgreSQL
    restart tests do that) that process is gone and the new postmaster would
    be left running. Point the hook at the postmaster running now."""
    from pgserver.utils import PostmasterInfo

    running = PostmasterInfo.read_from_pgdata(server.pgdata)
    if running is not None and running.is_running():
        server._postmaster_info = running


def attach_embedded_postgres(folder: Path | None = None) -> str:
    """Start (or join, when ``scripts/serve`` runs) the embedded PostgreSQL under
    the data folder and return its URL. It stays up while this process lives;
    the last process holding it stops it on exit (pgserver's own bookkeeping)."""
    import warnings

    with warnings.catch_warnings():
        # platformdirs warns that XDG_RUNTIME_DIR is unset (root, no login session).
        warnings.simplefilter("ignore")
        import pgserver
        import platformdirs

        platformdirs.user_runtime_path("python_PostgresServer")

    folder = folder or data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    _forget_dead_handles(folder / "postgres")
    server = pgserver.get_server(folder / "postgres", cleanup_mode="stop")
    atexit.register(_follow_restarts, server)  # runs before pgserver's hook (last in, first out)
    exists = server.psql(f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}';")
    if "(1 row)" not in exists:
        server.psql(f"CREATE DATABASE {DATABASE_NAME};")
    return server.get_uri().replace("/postgres?", f"/{DATABASE_NAME}?")


def prepare_manage_py(argv: list[str]) -> None:
    """Point a ``manage.py`` command at this checkout's embedded services when
    the environment names none: those of a running ``scripts/serve``, else an
    embedded PostgreSQL started for the command."""
    if os.environ.get("DATABASE_URL"):
        return
    # The embedded services are a development set-up: the built-in secret key
    # is fine for them (settings refuse it for an outside database).
    os.environ.setdefault("LMSP_DEVELOPMENT", "1")
    running = recorded()
    for name, url in running.items():
        os.environ.setdefault(name, url)
    command = argv[1] if len(argv) > 1 else "help"
    if "DATABASE_URL" not in running and command not in NO_DATABASE_COMMANDS:
        os.environ["DATABASE_URL"] = attach_embedded_postgres()
