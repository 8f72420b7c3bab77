"""The real service for end-to-end tests: web, model worker and ops worker
(Celery beat for the sweeper) as separate processes, against the test
database and Redis, so that tests can kill and restart any of them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar
from urllib.parse import quote

import httpx

from lmsp_project.devstack import free_port, start_redis

ROOT = Path(__file__).resolve().parent.parent
LOGS = ROOT / "test-artifacts" / "logs"

# Short timings so that crash and retention tests run in seconds. Flushes
# run at the shipped interval (LMSP_FLUSH_INTERVAL_SECONDS is not set here).
STACK_SETTINGS = {
    "LMSP_LEASE_SECONDS": "3",
    "LMSP_SWEEP_INTERVAL_SECONDS": "1",
    "LMSP_REQUEUE_AFTER_SECONDS": "4",
    "LMSP_STREAM_POLL_SECONDS": "1",
    "LMSP_KEEPALIVE_SECONDS": "1",
    # A stalled upload is answered within seconds (tests/test_hostile_input_e2e.py).
    "LMSP_BODY_TIMEOUT_SECONDS": "4",
    # A small window and pages: replays from the database are exercised too.
    "LMSP_STREAM_CHECK_SECONDS": "2",
    "LMSP_STREAM_WINDOW_EVENTS": "32",
    "LMSP_STREAM_PAGE_EVENTS": "16",
    # A revoked token whose message was lost: its streams end within seconds.
    "LMSP_STREAM_ACCESS_CHECK_SECONDS": "2",
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

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout: float = 120) -> None:
        start_together([self], timeout)

    def launch(self) -> int:
        """Start the process; the offset in its log after which it says it is ready."""
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
        return offset

    def wait_until_ready(self, offset: int, deadline: float) -> None:
        assert self.process is not None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; see {self.log_path}")
            with open(self.log_path) as f:
                f.seek(offset)
                if self.ready in f.read():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready in time; see {self.log_path}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            self.process.wait(30)

    def stop(self) -> None:
        stop_together([self])


def start_together(procs: Iterable[Proc], timeout: float = 120) -> None:
    """Start ``procs`` at once and wait until each is ready: their starts
    (imports, a model's load) overlap instead of adding up."""
    launched = [(proc, proc.launch()) for proc in procs]
    deadline = time.monotonic() + timeout
    for proc, offset in launched:
        proc.wait_until_ready(offset, deadline)


def stop_together(procs: Iterable[Proc]) -> None:
    """SIGTERM to each of ``procs`` that runs, then wait for all: their
    shutdowns (a web process's grace for its streams) overlap."""
    stopping = [proc for proc in procs if proc.process and proc.process.poll() is None]
    for proc in stopping:
        assert proc.process is not None
        os.killpg(proc.process.pid, signal.SIGTERM)
    for proc in stopping:
        assert proc.process is not None
        proc.process.wait(30)


class Stack:
    """The service's processes, with a Redis of their own that tests may restart."""

    running: ClassVar[Stack | None] = None  # the one started, for tests that pause a part

    def __init__(self, db: dict, redis_port: int, extra_env: dict[str, str] | None = None) -> None:
        from django.conf import settings

        self.port = free_port()
        self.redis_port = redis_port
        # The prefix of the queues the model worker consumes (tests may
        # change the setting for their own in-process runs).
        self.queue_prefix = settings.LMSP_QUEUE_PREFIX
        self.redis: subprocess.Popen | None = None
        self.paused = False  # the model worker takes no job (pause_worker)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
        self.redis_url = redis_url
        self.env = {
            **os.environ,
            **STACK_SETTINGS,
            "DATABASE_URL": database_url(db),
            "REDIS_URL": redis_url,
            "PYTHONUNBUFFERED": "1",
            "LMSP_DEVELOPMENT": "1",  # the built-in secret key is fine for tests
            **(extra_env or {}),
        }
        python = sys.executable
        self.web = self.another_web(self.port)
        self.worker = self.another_worker("worker")
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

    def another_web(self, port: int, name: str = "web", **settings: str) -> Proc:
        """A web process on ``port`` with the stack's database, Redis and
        settings, and ``settings`` on top (not started)."""
        argv = [sys.executable, "-m", "uvicorn", "lmsp_project.asgi:application"]
        # as the Procfile runs it: open streams are closed 5 s after a SIGTERM
        options = ["--no-access-log", "--no-proxy-headers", "--timeout-graceful-shutdown", "5"]
        return Proc(
            f"{name}-{port}",
            [*argv, "--host", "127.0.0.1", "--port", str(port), *options],
            {**self.env, **settings},
            # Logged once the socket listens; "Application startup complete"
            # comes before the bind, and a request then is refused.
            ready="Uvicorn running on",
        )

    def another_worker(self, name: str) -> Proc:
        """A model-worker process on the stack's database, Redis and settings,
        as a second host (or the next version of a deploy) runs it (not started)."""
        argv = [sys.executable, "-m", "workers.serve"]
        return Proc(f"{name}-{self.port}", argv, self.env, ready=" ready.")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.start_redis()
        start_together((self.web, self.worker, self.ops))
        Stack.running = self

    def stop(self) -> None:
        Stack.running = None
        stop_together((self.ops, self.worker, self.web))
        self.stop_redis()

    @contextmanager
    def stand_in(self, db: dict, extra_env: dict[str, str]) -> Iterator[Stack]:
        """Another stack (``extra_env`` on top, the same database and Redis)
        in place of this one, whose processes wait stopped meanwhile."""
        stop_together((self.ops, self.worker, self.web))
        other = Stack(db, self.redis_port, extra_env)
        Stack.running = other
        try:
            start_together((other.web, other.worker, other.ops))
            yield other
        finally:
            stop_together((other.ops, other.worker, other.web))
            Stack.running = self
            start_together((self.web, self.worker, self.ops))

    def start_redis(self) -> None:
        self.redis = start_redis(LOGS / f"redis-{self.redis_port}", self.redis_port, persist=False)

    def stop_redis(self) -> None:
        """Kill Redis outright: whatever it held (queued messages) is gone."""
        if self.redis is not None:
            self.redis.kill()
            self.redis.wait(10)

    def _worker_queues(self) -> tuple[str, list[str]]:
        """The running model worker's Celery name and the queues it consumes."""
        from generation.registry import served_models

        assert self.worker.process is not None
        name = f"models-{self.worker.process.pid}@{socket.gethostname()}"
        shared = [f"{self.queue_prefix}.{spec.slug}" for spec in served_models()]
        return name, [*shared, *(f"{queue}@{name}" for queue in shared)]

    def pause_worker(self) -> None:
        """The model worker stops taking jobs, as if it were stopped: what is
        submitted stays queued in Redis. Its process and loaded model stay,
        so ``resume_worker`` takes the queue again at once, where a restart
        takes about 12 s of a test (Celery's ``cancel_consumer``)."""
        self._tell_worker("cancel_consumer")
        # A fetch the worker began before the cancel waits up to kombu's
        # BRPOP timeout (1 s) and would hand a message back, not run it:
        # let it pass before the test submits anything.
        time.sleep(1.5)
        self.paused = True

    def resume_worker(self) -> None:
        """The paused model worker consumes its queues again."""
        self._tell_worker("add_consumer")
        self.paused = False

    def _tell_worker(self, command: str) -> None:
        """Celery's remote ``command`` for each of the model worker's queues."""
        from lmsp_project.celery import app

        name, queues = self._worker_queues()
        # No answer: the worker is not connected to Redis yet (after a
        # restart of Redis it reconnects with a back-off). Asked again: a
        # command it already carried out answers "ok" as well.
        deadline = time.monotonic() + 60
        with app.connection() as connection:
            for queue in queues:
                while not (
                    answer := app.control.broadcast(
                        command,
                        arguments={"queue": queue},
                        destination=[name],
                        reply=True,
                        timeout=10,
                        connection=connection,
                    )
                ):
                    assert time.monotonic() < deadline, f"{name} did not answer {command}"
                assert "ok" in answer[0][name], answer

    def wait_until_the_worker_is_idle(self, timeout: float) -> None:
        """Until the model worker (if it runs) has no message waiting in its
        queues, none reserved and no job running; raises past ``timeout``.
        A message goes from its queue to the worker's reserved jobs to its
        active ones: asked in that order, one in flight is always seen."""
        import redis
        from django.conf import settings

        from lmsp_project.celery import app
        from tasks_app.broker import queue_lists

        process = self.worker.process
        if process is None or process.poll() is not None:
            return  # no worker: nothing takes a message
        name, queues = self._worker_queues()
        client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5)
        deadline = time.monotonic() + timeout
        while True:
            waiting = sum(client.llen(key) for queue in queues for key in queue_lists(queue))
            # A connection of its own: a pooled one may be from before a
            # test restarted Redis.
            with app.connection() as connection:
                inspect = app.control.inspect(
                    destination=[name], timeout=5, limit=1, connection=connection
                )
                reserved = inspect.reserved() or {}
                active = inspect.active() or {}
            if not waiting and reserved.get(name) == [] and active.get(name) == []:
                return
            assert time.monotonic() < deadline, (
                f"the model worker is not idle: {waiting} messages waiting, "
                f"reserved {reserved}, active {active}"
            )
            time.sleep(0.1)

    def client(self, token: str, **kwargs: object) -> httpx.Client:
        options: dict = {
            "base_url": self.base_url,
            "timeout": httpx.Timeout(120, connect=10),
            **kwargs,
        }
        return httpx.Client(headers={"Authorization": f"Bearer {token}"}, **options)
