"""The service as the Procfile runs it, for the benchmarks that measure it
whole (``bench_concurrency.py``, ``bench_fairness.py``).

``procfile_service()`` starts what ``scripts/serve`` starts: the Procfile
under honcho (``LMSP_WEB_PROCESSES`` web processes, a model worker, the ops
worker with beat), with the shipped settings unless the environment sets
them, on the embedded PostgreSQL and a private Redis unless
``DATABASE_URL`` / ``REDIS_URL`` are set. It uses a database of its own
(``lmsp_bench_service``), so a bench never claims the development
database's queued tasks, and cancels whatever an interrupted run left
there. Django is set up in this process on the same database, for tokens
and for reading what the service wrote.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
os.environ.setdefault("LMSP_DEVELOPMENT", "1")  # a bench is a development run

DATABASE = "lmsp_bench_service"
LOGS = ROOT / "test-artifacts" / "bench"


@dataclass(frozen=True)
class Service:
    base_url: str
    log: Path

    def token(self, username: str, scopes: list[str]) -> str:
        from accounts_app.services import create_token

        return create_token(username=username, scopes=scopes).secret


def task_body(text: str, max_output_tokens: int, **request: object) -> dict:
    """The body of ``POST /lmsp/v1/tasks``: one user message to SmolLM2."""
    message = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    return {
        "type": "response",
        "request": {
            "model": "smollm2:135m",
            "input": [message],
            "max_output_tokens": max_output_tokens,
            **request,
        },
    }


def smollm2_models_file(variants: dict[str, str]) -> str:
    """A models.toml declaring the converted SmolLM2-135M weights once per
    variant: its id, and the TOML lines added to the shipped entry's."""
    cache = Path(os.environ.get("LMSP_MODEL_CACHE", ROOT / ".data" / "models"))
    entry = f"""
source = "folder"
path = "{cache / "smollm2-135m"}"
context_window = 8192
max_output_tokens = 4096
capabilities = ["conversations"]
"""
    return "\n".join(
        f'[[models]]\nid = "{model_id}"{entry}{extra}\n' for model_id, extra in variants.items()
    )


def bench_database(url: str, name: str) -> str:
    """The URL of database ``name`` beside ``url``'s, created and migrated."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone():
            conn.execute(f"CREATE DATABASE {name}")
    path = url.split("?")[0].rsplit("/", 1)
    bench_url = url.replace(path[0] + "/" + path[1], f"{path[0]}/{name}", 1)
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "--no-input", "-v", "0"],
        cwd=ROOT,
        env={**os.environ, "DATABASE_URL": bench_url},
        check=True,
    )
    return bench_url


def _wait_until_it_generates(base_url: str, token: str, timeout: float = 600) -> None:
    """Until a short generation completes: the web answers and a model worker
    has loaded its model."""
    import httpx

    body = task_body("Hi", 2)["request"]
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            answer = httpx.post(
                f"{base_url}/lmsp/v1/responses",
                json=body,
                headers={"Authorization": f"Bearer {token}"},
                timeout=120,
            )
            if answer.status_code == 200:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service did not answer within {timeout:.0f} s")
        time.sleep(0.5)


@contextlib.contextmanager
def _environment_restored(environment: dict[str, str]) -> Iterator[None]:
    try:
        yield
    finally:
        from django.db import connections

        connections.close_all()
        os.environ.clear()
        os.environ.update(environment)


@contextlib.contextmanager
def procfile_service(port: int = 8431, **settings: str) -> Iterator[Service]:
    """The Procfile's processes under honcho on ``port``, ``settings`` added to
    their environment; stopped (SIGTERM to honcho, which stops them) on exit.
    Each call starts its own embedded servers (or uses ``DATABASE_URL`` /
    ``REDIS_URL`` as the caller set them): this process's environment is put
    back and its connections closed on exit, so a second call (the next
    round of a bench) does not reach for the servers the first one stopped."""
    from lmsp_project.devstack import run_environment, services

    # SIGTERM unwinds like Ctrl-C: the service and the embedded servers are
    # stopped, not left behind.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    environment = dict(os.environ)
    with services() as started, _environment_restored(environment):
        os.environ.update(started)
        os.environ["DATABASE_URL"] = bench_database(os.environ["DATABASE_URL"], DATABASE)
        import django

        django.setup()
        from lmsp_core.status import FINAL_STATUSES
        from tasks_app import lifecycle
        from tasks_app.models import Task

        for task_id in Task.objects.exclude(status__in=FINAL_STATUSES).values_list("id", flat=True):
            lifecycle.request_cancel(task_id)  # an interrupted run's
        LOGS.mkdir(parents=True, exist_ok=True)
        log = LOGS / "procfile-service.log"
        env = {
            **run_environment(settings),
            "LMSP_HOST": "127.0.0.1",
            "LMSP_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
        }
        with open(log, "w") as output:
            honcho = subprocess.Popen(
                [sys.executable, "-m", "honcho", "start", "-f", str(ROOT / "Procfile")],
                cwd=ROOT,
                env=env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            service = Service(f"http://127.0.0.1:{port}", log)
            _wait_until_it_generates(service.base_url, service.token("bench", ["responses:write"]))
            yield service
        finally:
            honcho.send_signal(signal.SIGTERM)  # honcho stops its processes (SIGKILL after 5 s)
            try:
                honcho.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(honcho.pid, signal.SIGKILL)
                honcho.wait(10)
