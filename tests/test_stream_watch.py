"""What open streams cost the database while nothing happens, and what
catches a message Redis lost: the streams of this process, followed here
(``tasks_app.streams.follow_events``) against the real PostgreSQL and
Redis, their queries counted by ``event_reader.QUERIES`` (every statement
a stream makes after it opened).

Idle followers cost no query each: the feeds' safety check
(``LMSP_STREAM_CHECK_SECONDS``) and the check of the streams' tokens
(``LMSP_STREAM_ACCESS_CHECK_SECONDS``) are one query per process each.
A final event or a revocation whose message was lost (the writer could not
reach Redis, while this process's subscription stayed up) still ends the
stream at the next check."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from contextlib import aclosing

import pytest
from django.contrib.auth import get_user_model

from accounts_app.services import create_token, revoke_token
from lmsp_core.http import db_call
from lmsp_project.devstack import free_port
from responses_app.serializers import validate_response_request
from responses_app.submit import submit
from tasks_app import event_reader, feeds, lifecycle, streams
from tasks_app.event_log import StoredEvent
from tasks_app.models import Task, TaskKind
from tasks_app.notify import hub
from tasks_app.stream_access import StreamAccess

from .conftest import ALL_SCOPES, request_body

pytestmark = pytest.mark.django_db(transaction=True)

CHECK_SECONDS = 0.5


@pytest.fixture
def quick_checks(settings) -> None:  # noqa: ANN001
    """Jobs go to a queue no worker serves (the tasks stay queued, their
    followers idle); both periodic checks run every ``CHECK_SECONDS``."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-stream-watch"
    settings.LMSP_STREAM_CHECK_SECONDS = CHECK_SECONDS
    settings.LMSP_STREAM_ACCESS_CHECK_SECONDS = CHECK_SECONDS


def queued_tasks(count: int, token_id: int | None = None, username: str = "watcher") -> list[Task]:
    owner, _ = get_user_model().objects.get_or_create(username=username)
    request = validate_response_request(request_body(max_output_tokens=4))
    return [
        submit(
            owner,
            request,
            kind=TaskKind.TASK,
            idempotency_key=None,
            allowed_models=None,
            token_id=token_id,
        )
        for _ in range(count)
    ]


async def follow(task_id: str, got: list[StoredEvent], access: StreamAccess | None = None) -> None:
    async with aclosing(streams.follow_events(task_id, 0, access=access)) as events:
        async for event in events:
            if event is not None:  # not a keep-alive
                got.append(event)


async def until(condition: Callable[[], bool], timeout: float = 60) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.05)


async def close_pool() -> None:
    """This loop's pool, whose connections would outlive the test."""
    pool = event_reader._pools.pop(asyncio.get_running_loop(), None)
    if pool is not None:
        await pool.close()


def placed(task_id: str) -> bool:
    """Whether the feed of this queued task has read its place in the queue."""
    feed = feeds._feeds.get(task_id)
    return feed is not None and feed.queue_position is not None


def lose_messages(settings) -> None:  # noqa: ANN001
    """Writers of this process publish to a Redis that is not there from now
    on (each publish fails and is logged), while the subscription of this
    process's hub, made before, stays up: every message is lost."""
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"


def test_idle_followers_of_many_tasks_cost_one_query_a_check_not_one_each(quick_checks, broker):
    """Thirty followers, each of its own queued task and with the access of
    the same token: while they wait, each periodic check is one query for
    all of them (before: one read of its task per feed and period)."""
    issued = create_token(username="watcher", scopes=ALL_SCOPES)
    tasks = queued_tasks(30, issued.token.pk)

    async def idle_queries() -> tuple[int, float]:
        loop = asyncio.get_running_loop()
        got: dict[str, list[StoredEvent]] = {task.id: [] for task in tasks}
        followers = [
            asyncio.create_task(follow(task.id, got[task.id], StreamAccess.of(issued.token)))
            for task in tasks
        ]
        try:
            await until(lambda: hub.healthy and all(got.values()))
            await asyncio.sleep(1)  # each feed has read its queue position, once
            before, started = event_reader.QUERIES, loop.time()
            await asyncio.sleep(8 * CHECK_SECONDS)
            assert not any(follower.done() for follower in followers)
            return event_reader.QUERIES - before, loop.time() - started
        finally:
            for follower in followers:
                follower.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
            await close_pool()

    queries, seconds = asyncio.run(idle_queries())
    checks = 2 * (seconds / CHECK_SECONDS + 1)  # the feeds' and the tokens', per process
    assert queries <= checks, f"{queries} queries in {seconds:.1f} s by 30 idle followers"


def test_a_final_event_whose_message_was_lost_ends_the_stream_at_the_check(
    quick_checks, broker, settings
):
    (task,) = queued_tasks(1)

    async def followed() -> list[StoredEvent]:
        got: list[StoredEvent] = []
        follower = asyncio.create_task(follow(task.id, got))
        try:
            # and the feed has read its place in the queue, its one read of
            # its own while queued: from now on only the check reads the task
            await until(lambda: hub.healthy and bool(got) and placed(task.id))
            lose_messages(settings)
            await db_call(lifecycle.request_cancel, task.id)  # ends it: the final event
            await asyncio.wait_for(follower, 60)  # found by the safety check
            assert hub.healthy  # not a reconnect's read: the subscription never dropped
            return got
        finally:
            follower.cancel()
            await close_pool()

    events = asyncio.run(followed())
    assert [event.event for event in events] == ["response.created", "response.cancelled"]


def test_a_revocation_whose_message_was_lost_ends_the_stream_at_the_check(
    quick_checks, broker, settings
):
    issued = create_token(username="watcher", scopes=ALL_SCOPES)
    (task,) = queued_tasks(1, issued.token.pk)

    async def followed() -> list[StoredEvent]:
        got: list[StoredEvent] = []
        follower = asyncio.create_task(follow(task.id, got, StreamAccess.of(issued.token)))
        try:
            await until(lambda: hub.healthy and bool(got))
            lose_messages(settings)
            assert await db_call(revoke_token, issued.secret) == 1
            await asyncio.wait_for(follower, 60)  # found by the tokens' check
            assert hub.healthy
            return got
        finally:
            follower.cancel()
            await close_pool()

    events = asyncio.run(followed())
    assert [event.event for event in events] == ["response.created", "error"]
    assert json.loads(events[-1].data)["error"]["code"] == "unauthorized"
