"""Event streams under failure and at scale, on the real stack: idle followers
cost the database nothing while Redis is up, streams outlive PostgreSQL and
Redis restarts, a failed database read never cancels a direct generation,
retention under a reader ends its stream, and the stream caps answer problem
documents."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from contextlib import aclosing
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, connections, transaction

from lmsp_core.status import FINAL_STATUSES
from lmsp_project.devstack import free_port
from responses_app.serializers import validate_response_request
from responses_app.submit import submit
from tasks_app import event_reader
from tasks_app.models import Task, TaskKind, UsageRecord
from tasks_app.retention import prune_events
from tasks_app.streams import follow_events

from .conftest import LONG_STORY, make_token, parse_sse, request_body, run_again, user_message
from .test_tasks_e2e import create_task, read_events, wait_for, wait_for_events

pytestmark = pytest.mark.e2e

FINAL_EVENTS = {
    "response.completed",
    "response.incomplete",
    "response.failed",
    "response.cancelled",
}


@pytest.fixture
def restart_after(stack):
    """Whatever a test stops or pauses (Redis, PostgreSQL, a process) runs
    again afterwards."""
    yield
    if stack.redis is None or stack.redis.poll() is not None:
        stack.start_redis()
    if not _postgres_running():
        _pg_start()
    connections.close_all()
    run_again(stack)


class Follower(threading.Thread):
    """One client reading an event stream to its end, in a thread."""

    def __init__(
        self, stack, token: str, path: str, method: str = "GET", port: int | None = None, **kwargs
    ) -> None:
        super().__init__(daemon=True)
        self.stack, self.token, self.path, self.method, self.kwargs = (
            stack,
            token,
            path,
            method,
            kwargs,
        )
        self.base_url = f"http://127.0.0.1:{port or stack.port}"
        self.events: list[dict] = []
        self.arrivals: list[float] = []  # time.monotonic() of each event's arrival
        self.status: int | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            with self.stack.client(self.token, base_url=self.base_url) as client:
                with client.stream(self.method, self.path, **self.kwargs) as answer:
                    self.status = answer.status_code
                    buffer = ""
                    for chunk in answer.iter_text():
                        buffer += chunk
                        *blocks, buffer = buffer.split("\n\n")
                        if blocks:
                            arrived = parse_sse("\n\n".join(blocks) + "\n\n")
                            self.arrivals += [time.monotonic()] * len(arrived)
                            self.events += arrived
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def wait_for(self, count: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.events) < count:
            assert self.is_alive() or len(self.events) >= count, (self.status, self.error)
            assert time.monotonic() < deadline, f"{len(self.events)} events, not {count}"
            time.sleep(0.05)

    def finish(self, timeout: float = 180) -> list[dict]:
        self.join(timeout)
        assert not self.is_alive(), "the stream did not end"
        assert self.error is None, self.error
        assert self.status == 200
        return self.events


def assert_contiguous(events: list[dict], task: dict) -> None:
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] == f"response.{task['status']}"
    assert events[-1]["id"] == task["last_event_id"]


# --- the embedded PostgreSQL, stopped and started for real ------------------------


def _pgdata() -> Path:
    host = Path(connection.settings_dict["HOST"] or "/nonexistent")
    assert (host / "PG_VERSION").exists(), "these tests restart the embedded PostgreSQL"
    return host


def _pg_ctl(*args: str) -> None:
    from pgserver._commands import pg_ctl

    # As root, pgserver runs PostgreSQL as its own system user (NOTES.md).
    user = "pgserver" if os.geteuid() == 0 else None
    pg_ctl(list(args), pgdata=_pgdata(), user=user, timeout=60)


def _postgres_running() -> bool:
    pid_file = _pgdata() / "postmaster.pid"
    return pid_file.exists()


def _pg_stop() -> None:
    connections.close_all()
    _pg_ctl("-w", "-m", "fast", "stop")


def _pg_start() -> None:
    pgdata = _pgdata()
    _pg_ctl("-w", "-o", '-h ""', "-o", f"-k {pgdata}", "-l", str(pgdata / "log"), "start")
    connections.close_all()


def _log_reads() -> int:
    """Scans of the task and event tables so far: every read a stream makes
    (its task's position, its events) is one; autovacuum and the test's
    own bookkeeping are not."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT sum(coalesce(seq_scan, 0) + coalesce(idx_scan, 0)) FROM pg_stat_user_tables"
            " WHERE relname IN ('tasks_app_task', 'tasks_app_event')"
        )
        return int(cursor.fetchone()[0])


# A backend idle less than a second after its last report of its counts
# keeps them up to 10 s (PostgreSQL's PGSTAT_IDLE_INTERVAL).
STATS_SETTLE_SECONDS = 11


def _reads_during(seconds: float) -> int:
    """Reads in a window of ``seconds``, counted once they are all reported.
    Reads from before the window that were not yet reported count too (at
    most those of the 10 s before it): the caller lets them settle first
    where that matters."""
    before = _log_reads()
    time.sleep(seconds)
    time.sleep(STATS_SETTLE_SECONDS)
    return _log_reads() - before


# --- tests ---------------------------------------------------------------------------


# A feed's safety check (every 2 s on the test stack) reads its task while
# Redis is up: here it is pushed past the test, so that what idle followers
# read, on top of it, is counted alone.
NO_SAFETY_CHECK = {"LMSP_STREAM_CHECK_SECONDS": "3600"}


def test_idle_followers_make_no_queries_until_redis_goes_away(api, stack, token, restart_after):
    from lmsp_project.devstack import free_port

    stack.pause_worker()  # the task stays queued: its followers are idle
    stack.ops.stop()  # and no sweeper queries meanwhile
    port = free_port()
    quiet = stack.another_web(port, "web-no-safety-check", **NO_SAFETY_CHECK)
    quiet.start()
    try:
        task = create_task(api, max_output_tokens=4)
        path = f"/lmsp/v1/tasks/{task['id']}/events"
        followers = [Follower(stack, token, path, port=port) for _ in range(40)]
        for follower in followers:
            follower.wait_for(1)
        # 40 idle followers of a queued task, Redis up: not one read of the
        # task or its events (before the feeds: two per follower per second).
        time.sleep(STATS_SETTLE_SECONDS)  # the reads of their starts reported
        idle = _reads_during(4)
        assert idle == 0, f"{idle} reads of the log by 40 idle followers"

        stack.stop_redis()
        # the task's feed now reads the database itself (what came before
        # is reported: the idle window settled)
        polled = _reads_during(4)
        assert polled >= 8, f"only {polled} reads while Redis was down"
        # per task (about one a second here), not per follower (80 a second before)
        assert polled < 40 * 15, f"{polled} reads while Redis was down"
        answer = api.post(f"/lmsp/v1/tasks/{task['id']}/cancel")  # published to nobody
        assert answer.status_code == 200
        done = wait_for(api, task["id"])
        for follower in followers:
            events = follower.finish(60)
            assert [e["event"] for e in events] == ["response.created", "response.cancelled"]
            assert_contiguous(events, done)
    finally:
        quiet.stop()


def test_stream_survives_postgres_and_redis_restarts(api, stack, token, restart_after):
    # PostgreSQL restarts while the followers wait (a running worker would
    # fail its task on a lost connection: that is the worker's business, not
    # the stream's); Redis restarts while the events flow.
    stack.worker.stop()
    task = create_task(api, input=[user_message(LONG_STORY)], max_output_tokens=200)
    path = f"/lmsp/v1/tasks/{task['id']}/events"
    followers = [Follower(stack, token, path) for _ in range(3)]
    followers[0].wait_for(1)
    _pg_stop()
    time.sleep(3)  # the feed's checks fail meanwhile
    _pg_start()
    stack.worker.start()
    followers[0].wait_for(10, timeout=120)  # events flow after the restart
    stack.stop_redis()  # the hub loses its subscription, the worker its publishing
    time.sleep(2)
    stack.start_redis()
    done = wait_for(api, task["id"], timeout=300)
    replay = read_events(api, task["id"])
    assert_contiguous(replay, done)
    for follower in followers:
        assert follower.finish() == replay  # every event once, in order, across both restarts
    assert len(replay) > 20


def test_a_pool_of_dead_connections_serves_at_once_after_a_postgres_restart(transactional_db):
    """Six idle pooled connections, as a worker's threads leave them, all dead
    after the restart: the first query gets a new one (``lmsp_project.postgresql``)
    instead of trying each dead one after a longer back-off, 31 s in all,
    past the pool's 30 s."""
    get_user_model().objects.create(username="written-before-the-restart")
    holding = threading.Barrier(6)

    def borrow() -> None:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
        holding.wait(30)  # all six out of the pool at once: six connections
        connection.close()  # back to the pool, idle

    threads = [threading.Thread(target=borrow) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert connection.pool.get_stats()["pool_available"] >= 6
    _pg_stop()
    _pg_start()
    asked = time.monotonic()
    users = list(get_user_model().objects.values_list("username", flat=True))
    assert users == ["written-before-the-restart"]  # served, not PoolTimeout
    # at once: not after trying the dead connections one by one (31 s)
    assert time.monotonic() - asked < 10


def test_direct_stream_is_not_cancelled_when_its_database_reads_fail(
    api, stack, token, restart_after
):
    stack.worker.stop()  # queued: the stream waits, reading only the database
    log_offset = stack.web.log_path.stat().st_size
    stream = Follower(
        stack,
        token,
        "/lmsp/v1/responses",
        method="POST",
        json=request_body(stream=True, max_output_tokens=8),
    )
    stream.wait_for(1)
    _pg_stop()
    time.sleep(4)  # the feed's checks (every 2 s here) fail meanwhile
    _pg_start()
    with open(stack.web.log_path) as log:
        log.seek(log_offset)
        assert "could not read the database" in log.read()
    stack.worker.start()
    events = stream.finish()
    assert events[-1]["event"] in ("response.completed", "response.incomplete")
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    # delivered, so the store: false response is gone; its accounting stays
    usage = UsageRecord.objects.get(response_id=events[0]["data"]["response_id"])
    assert usage.status == events[-1]["data"]["status"]


def test_pruning_under_a_reader_ends_its_stream_and_the_reconnect_gets_410(api, stack, token):
    task = wait_for(api, create_task(api, max_output_tokens=4)["id"])
    path = f"/lmsp/v1/tasks/{task['id']}/events"
    with transaction.atomic():
        # The reader passes the 410 check (tasks are not locked), then its
        # read of the events waits for this transaction, which prunes them.
        with connection.cursor() as cursor:
            cursor.execute("LOCK TABLE tasks_app_event IN ACCESS EXCLUSIVE MODE")
        reader = Follower(stack, token, path)
        deadline = time.monotonic() + 30
        while not _reader_waits_for_lock():
            assert time.monotonic() < deadline, "the reader never read the events"
            time.sleep(0.05)
        assert prune_events(older_than=0) == task["last_event_id"]
    events = reader.finish(30)
    assert not any(e["event"] in FINAL_EVENTS for e in events)  # it ended, unfinished
    last_seen = events[-1]["id"] if events else 0
    again = api.get(path, headers={"Last-Event-ID": str(last_seen)})
    assert again.status_code == 410
    assert again.json()["code"] == "event_history_expired"


def _reader_waits_for_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # fresh inside our transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
            " AND query LIKE '%%tasks_app_event%%' AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0] > 0


def _raw_stream(
    port: int, token: str, path: str, body: bytes = b"", headers: str = ""
) -> tuple[socket.socket, int, str]:
    """An event stream held open on a plain socket: (socket, status, head).
    With a ``body``, POSTed as JSON (``headers``: more header lines)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    method = "POST" if body else "GET"
    if body:
        headers += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    sock.sendall(
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n"
        f"{headers}\r\n".encode()
        + body
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the answer"
        head += chunk
    text = head.decode("latin-1")
    return sock, int(text.split(" ", 2)[1]), text


def test_stream_caps_answer_overloaded_problem_documents(api, stack, token, restart_after):
    stack.pause_worker()  # the task stays queued: its streams stay open
    task = create_task(api, max_output_tokens=4)
    path = f"/lmsp/v1/tasks/{task['id']}/events"
    port = free_port()
    capped = stack.another_web(
        port, "web-capped", LMSP_MAX_STREAMS_PER_TOKEN="2", LMSP_MAX_STREAMS_PER_PROCESS="3"
    )
    capped.start()
    other = make_token("bob")
    try:
        first, second = (_raw_stream(port, token, path) for _ in range(2))
        assert first[1] == second[1] == 200
        sock, status, head = _raw_stream(port, token, path)
        assert status == 503, head
        assert "application/problem+json" in head and "retry-after: 5" in head.lower()
        assert '"code":"overloaded"' in head.replace(" ", "") or b"overloaded" in sock.recv(65536)
        sock.close()
        # another owner's token: not per-token, but the process is full after one more
        bob_task = _create_as(stack, other)
        bob_path = f"/lmsp/v1/tasks/{bob_task}/events"
        third = _raw_stream(port, other, bob_path)
        assert third[1] == 200
        sock, status, head = _raw_stream(port, other, bob_path)
        assert status == 503 and "retry-after" in head.lower()
        sock.close()
        # a closed stream gives its place back
        first[0].close()
        deadline = time.monotonic() + 20
        while True:
            sock, status, head = _raw_stream(port, token, path)
            if status == 200:
                sock.close()
                break
            sock.close()
            assert time.monotonic() < deadline, "a closed stream kept its place"
            time.sleep(0.2)
        for held in (second, third):
            held[0].close()
    finally:
        capped.stop()


def _create_as(stack, token: str) -> str:
    with stack.client(token) as client:
        return create_task(client, max_output_tokens=4)["id"]


def test_late_joiner_replays_a_long_history_in_pages(api, stack, token):
    # The stack keeps a window of 32 events and pages of 16: a follower from 0
    # replays most of this task from the database, page by page.
    task = create_task(api, input=[user_message(LONG_STORY)], max_output_tokens=120)
    wait_for_events(task["id"], 60, timeout=240)  # a loaded machine generates slowly
    early = Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events")
    late = [Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events") for _ in range(5)]
    done = wait_for(api, task["id"], timeout=180)
    first = early.finish()
    assert_contiguous(first, done)
    for follower in late:
        assert follower.finish() == first


def test_a_direct_stream_started_from_its_first_events_gets_those_it_missed(stack, token):
    """The process that creates a direct task starts its stream from the events
    the task was created with, reading nothing back (``TaskFeed.seed``): the
    read would run beside the worker's claim. The worker may write, and
    publish to nobody, more events before the stream listens; here the whole
    answer. The stream still gets every event, in order, and ends."""
    owner = get_user_model().objects.get(username="alice")
    request = validate_response_request(request_body(stream=True, max_output_tokens=4))
    task = submit(owner, request, kind=TaskKind.DIRECT, idempotency_key=None, allowed_models=None)
    assert [e.id for e in task.events_at_creation] == [1]
    deadline = time.monotonic() + 120
    while (done := Task.objects.get(id=task.id)).status not in FINAL_STATUSES:
        assert time.monotonic() < deadline, done.status
        time.sleep(0.05)

    async def follow() -> list:
        try:
            async with aclosing(follow_events(task.id, 0, task.events_at_creation)) as events:
                return [event async for event in events if event is not None]
        finally:  # this loop's pool, whose connections would outlive the test
            await event_reader._pools.pop(asyncio.get_running_loop()).close()

    events = asyncio.run(asyncio.wait_for(follow(), 60))
    assert events[0] == task.events_at_creation[0]
    assert [e.id for e in events] == list(range(1, done.last_event_id + 1))
    assert events[-1].event in FINAL_EVENTS
