"""The real service for end-to-end tests: web, model worker and ops worker
(Celery beat for the sweeper) as separate processes, against the test
database and Redis, so that tests can kill and restart any of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote

import httpx

from lmsp_project.devstack import free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "test-artifacts" / "logs"

# Short timings so that crash and retention tests run in seconds.
STACK_SETTINGS = {
    "LMSP_LEASE_SECONDS": "3",
    "LMSP_SWEEP_INTERVAL_SECONDS": "1",
    "LMSP_REQUEUE_AFTER_SECONDS": "4",
    "LMSP_STREAM_POLL_SECONDS": "1",
    "LMSP_FLUSH_INTERVAL_SECONDS": "0.05",
    "LMSP_KEEPALIVE_SECONDS": "1",
    # A stalled upload is answered within seconds (tests/test_hostile_input_e2e.py).
    "LMSP_BODY_TIMEOUT_SECONDS": "4",
    # A small window and pages: replays from the database are exercised too.
    "LMSP_STREAM_CHECK_SECONDS": "2",
    "LMSP_STREAM_WINDOW_EVENTS": "32",
    "LMSP_STREAM_PAGE_EVENTS": "16",
}


def database_url(db: dict) -> str:
    auth = quote(db["USER"] or "postgres")
    if db["PASSWORD"]:
        auth += ":" + quote(db["PASSWORD"])
    host = db["HOST"] or ""
    if host.startswith("/"):
        return f"postgresql://{auth}@/{db['NAME']}?host={quote(host)}"
    port = f":{db['PORT']}" if db["PORT"] else ""
    return f"postgresql://{auth}@{host}{port}/{db['NAME']}"


class Proc:
    """One service process with its log file; can be killed and started again."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready: str) -> None:
        self.name, self.argv, self.env, self.ready = name, argv, env, ready
        self.process: subprocess.Popen | None = None
        self.log_path = LOGS / f"{name}.log"
        self.starts = 0

    def start(self, timeout: float = 120) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = open(self.log_path, "a")  # noqa: SIM115 - the child holds it
        log.write(f"\n===== start {self.starts} =====\n")
        log.flush()
        offset = self.log_path.stat().st_size
        self.process = subprocess.Popen(
            self.argv,
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {self.log_path}")
            with open(self.log_path) as f:
                f.seek(offset)
                if self.ready in f.read():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout}s; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(30)

    def stop(self) -> None:
        self.kill(signal.SIGTERM)


class Stack:
    """The service's processes, with a Redis of their own that tests may restart."""

    running: ClassVar[Stack | None] = None  # the one started, for tests that pause a part

    def __init__(self, db: dict, redis_port: int) -> None:
        self.port = free_port()
        self.redis_port = redis_port
        self.redis: subprocess.Popen | None = None
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.redis_url = redis_url
        self.env = {
            **os.environ,
            **STACK_SETTINGS,
            "DATABASE_URL": database_url(db),
            "REDIS_URL": redis_url,
            "PYTHONUNBUFFERED": "1",
            "LMSP_DEVELOPMENT": "1",  # the built-in secret key is fine for tests
        }
        python = sys.executable
        self.web = Proc(
            f"web-{self.port}",
            [
                python,
                "-m",
                "uvicorn",
                "lmsp_project.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-access-log",
            ],
            self.env,
            ready="Application startup complete",
        )
        self.worker = Proc(
            f"worker-{self.port}", [python, "-m", "workers.serve"], self.env, ready=" ready."
        )
        self.ops = Proc(
            f"ops-{self.port}",
            [
                python,
                "-m",
                "celery",
                "-A",
                "lmsp_project",
                "worker",
                "--pool",
                "solo",
                "--queues",
                "lmsp.control",
                "--hostname",
                f"ops-{self.port}@%h",
                "--beat",
                "--schedule",
                str(LOGS / f"beat-{self.port}"),
                "--loglevel",
                "INFO",
            ],
            self.env,
            ready=" ready.",
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.start_redis()
        for proc in (self.web, self.worker, self.ops):
            proc.start()
        Stack.running = self

    def stop(self) -> None:
        Stack.running = None
        for proc in (self.ops, self.worker, self.web):
            proc.stop()
        self.stop_redis()

    def start_redis(self) -> None:
        self.redis = start_redis(LOGS / f"redis-{self.redis_port}", self.redis_port, persist=False)

    def stop_redis(self) -> None:
        """Kill Redis outright: whatever it held (queued messages) is gone."""
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(10)

    def another_web(self, name: str, settings: dict[str, str]) -> tuple[Proc, int]:
        """One more web process (not started yet) on the stack's database and
        Redis, with ``settings`` over the stack's, on a port of its own."""
        port = free_port()
        argv = [*self.web.argv[:-5], "--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
        env = {**self.env, **settings}
        return Proc(f"{name}-{port}", argv, env, ready="Application startup complete"), port

    def client(self, token: str, **kwargs: object) -> httpx.Client:
        options: dict = {"timeout": httpx.Timeout(120, connect=10), **kwargs}
        return httpx.Client(
            base_url=self.base_url, headers={"Authorization": f"Bearer {token}"}, **options
        )
