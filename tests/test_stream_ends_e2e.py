"""How streams end, on the real stack (issue 29, items 7 and 8): never as if
whole over events they missed, past an old failure once a task is re-queued,
and within seconds of their token's revocation."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from contextlib import aclosing
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection, transaction
from django.utils import timezone

from accounts_app.models import ApiToken
from lmsp_core.http import db_call
from lmsp_core.status import FINAL_STATUSES
from responses_app import direct
from responses_app.models import Response
from responses_app.records import UNDELIVERED_GRACE
from responses_app.retention import prune_history
from responses_app.serializers import validate_response_request
from responses_app.submit import submit
from tasks_app import claims, event_reader, lifecycle, sweeper
from tasks_app.models import Task, TaskKind
from tasks_app.retention import prune_events
from tasks_app.stream_access import StreamAccess

from .conftest import LONG_STORY, make_token, request_body
from .test_streams_e2e import FINAL_EVENTS, Follower, _reader_waits_for_lock
from .test_tasks_e2e import create_task, wait_for

pytestmark = pytest.mark.e2e


# --- item 7: a gap never ends a stream as if it were whole -------------------------------


def test_a_slow_direct_reader_gets_its_whole_answer_though_it_was_discarded(stack, token, settings):
    """A direct ``store: false`` answer is discarded once it has ended and its
    grace has passed, even when its reader is still behind (a client reading
    slowly). That reader still gets every event and the final one: the
    direct feed keeps them all (before, it was left with the window, paged
    back into a deleted log, found nothing and ended as if complete: the
    chat route then sent ``[DONE]``)."""
    settings.LMSP_STREAM_WINDOW_EVENTS = 32  # as the stack's, an int as the service reads it
    owner = get_user_model().objects.get(username="alice")
    request = validate_response_request(request_body(LONG_STORY, stream=True, max_output_tokens=80))
    task = submit(owner, request, kind=TaskKind.DIRECT, idempotency_key=None, allowed_models=None)
    access = StreamAccess.of(ApiToken.objects.get(owner=owner))

    def ended_and_discarded() -> int | None:
        done = Task.objects.filter(id=task.id).first()
        if done is None or done.status not in FINAL_STATUSES:
            return None
        assert done.last_event_id > 32 + 8 + 1, "the answer must outgrow a window"
        Task.objects.filter(id=task.id).update(
            completed_at=timezone.now() - UNDELIVERED_GRACE - timedelta(seconds=1)
        )
        prune_history()
        assert not Response.objects.filter(id=task.response_id).exists()
        return done.last_event_id

    async def read() -> tuple[list, int]:
        got, last = [], None
        try:
            async with aclosing(direct.delivered_events(task, True, access)) as events:
                async for event in events:
                    if event is not None:
                        got.append(event)
                    while last is None:  # the client stops reading after the first event
                        last = await db_call(ended_and_discarded)
                        await asyncio.sleep(0.2)
            return got, last
        finally:  # this loop's pool, whose connections would outlive the test
            await event_reader._pools.pop(asyncio.get_running_loop()).close()

    events, last = asyncio.run(asyncio.wait_for(read(), 240))
    assert [e.id for e in events] == list(range(1, last + 1))
    assert events[-1].event in FINAL_EVENTS


def test_an_openai_follower_behind_pruned_events_ends_with_an_error(stack, token):
    """``GET /v1/responses/{id}?stream=true`` whose events are pruned under it:
    before, the stream just ended (an SDK sees a normal end); now its last
    event is an ``error`` saying the history expired."""
    with stack.client(token) as api:
        started = api.post(
            "/v1/responses",
            json={
                "model": "smollm2:135m",
                "input": "Hi.",
                "max_output_tokens": 4,
                "background": True,
            },
        ).json()
        deadline = time.monotonic() + 120
        while api.get(f"/v1/responses/{started['id']}").json()["status"] not in FINAL_STATUSES:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    with transaction.atomic():
        # The reader passes the 410 check, then its read of the events waits
        # for this transaction, which prunes them (test_streams_e2e does the same).
        with connection.cursor() as cursor:
            cursor.execute("LOCK TABLE tasks_app_event IN ACCESS EXCLUSIVE MODE")
        reader = Follower(stack, token, f"/v1/responses/{started['id']}?stream=true")
        deadline = time.monotonic() + 30
        while not _reader_waits_for_lock():
            assert time.monotonic() < deadline, "the reader never read the events"
            time.sleep(0.05)
        assert prune_events(older_than=0) > 0
    events = reader.finish(30)
    assert events and events[-1]["event"] == "error", events
    assert events[-1]["data"]["code"] == "event_history_expired"
    assert not any(e["event"] in FINAL_EVENTS for e in events)


# --- item 8: re-queued tasks are followed past their old failure -------------------------


def test_a_follower_of_a_requeued_task_gets_the_new_run(api, stack, token, restart_after, settings):
    """A task fails (its worker lost, the sweeper gives up), an operator
    re-queues it (``lifecycle.requeue_failed``, the admin's action). A
    follower resuming after the old ``response.failed`` gets the new run's
    events (before: an empty 200, again and again), and so does one from the
    start, through the old failure."""
    stack.pause_worker()  # the task waits; the test plays the worker that is lost
    task = create_task(api, max_output_tokens=8)
    settings.LMSP_MAX_ATTEMPTS = 1
    with transaction.atomic():  # the stack's own sweeper sees it failed, never expired
        assert claims.claim(task["id"], "lost@host").attempt == 1
        Task.objects.filter(id=task["id"]).update(lease_expires_at=timezone.now() - timedelta(1))
        assert sweeper.sweep().ended == [task["id"]]
    failed = api.get(f"/lmsp/v1/tasks/{task['id']}").json()
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_lost"
    path = f"/lmsp/v1/tasks/{task['id']}/events"
    old_end = failed["last_event_id"]
    assert api.get(path, headers={"Last-Event-ID": str(old_end)}).status_code == 204

    lifecycle.requeue_failed(task["id"])
    after_failure = Follower(stack, token, path, headers={"Last-Event-ID": str(old_end)})
    from_start = Follower(stack, token, path)
    after_failure.wait_for(1, timeout=30)  # the new run's response.created, while queued
    assert after_failure.events[0]["id"] == old_end + 1
    assert after_failure.events[0]["event"] == "response.created"
    stack.resume_worker()

    done = wait_for(api, task["id"])
    assert done["status"] in ("completed", "incomplete")
    new_run = after_failure.finish(60)
    assert [e["id"] for e in new_run] == list(range(old_end + 1, done["last_event_id"] + 1))
    assert new_run[-1]["event"] == f"response.{done['status']}"
    whole = from_start.finish(60)
    assert [e["id"] for e in whole] == list(range(1, done["last_event_id"] + 1))
    assert whole[old_end - 1]["event"] == "response.failed" and whole[old_end:] == new_run


# --- item 8: revocation ends open streams --------------------------------------------------


def _queued_follower(api, stack, token: str) -> tuple[dict, Follower]:
    """A follower of a task that waits in the queue (the worker is paused):
    its stream stays open until something ends it."""
    task = create_task(api, max_output_tokens=4)
    follower = Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events")
    follower.wait_for(1, timeout=30)
    return task, follower


def _ended_within(follower: Follower, since: float, seconds: float) -> list[dict]:
    events = follower.finish(seconds + 30)
    took = time.monotonic() - since
    assert took < seconds, f"the stream ended {took:.1f} s after its token was revoked"
    assert not any(e["event"] in FINAL_EVENTS for e in events)
    return events


def test_a_revoked_tokens_open_streams_end_within_5_s(api, stack, token, restart_after):
    stack.pause_worker()
    task, follower = _queued_follower(api, stack, token)
    background = {"model": "smollm2:135m", "input": "Hi.", "background": True}
    response_id = api.post("/v1/responses", json=background).json()["id"]
    openai_stream = Follower(stack, token, f"/v1/responses/{response_id}?stream=true")
    openai_stream.wait_for(1, timeout=30)
    other_token = make_token("alice")  # the same owner's other token keeps its streams
    task_of_other, other = _queued_follower(api, stack, other_token)

    revoked_at = time.monotonic()
    call_command("lmsp_token", "revoke", token)
    _ended_within(follower, revoked_at, 5)
    cut = _ended_within(openai_stream, revoked_at, 5)
    assert cut[-1]["event"] == "error" and cut[-1]["data"]["code"] == "unauthorized"
    again = api.get(f"/lmsp/v1/tasks/{task['id']}/events")
    assert again.status_code == 401 and again.json()["code"] == "unauthorized"
    assert other.is_alive()  # still open
    # a deactivated owner: every token of theirs
    alice = get_user_model().objects.get(username="alice")
    deactivated_at = time.monotonic()
    alice.is_active = False
    alice.save()
    _ended_within(other, deactivated_at, 5)
    with stack.client(other_token) as client:
        assert client.get(f"/lmsp/v1/tasks/{task_of_other['id']}/events").status_code == 401


def test_an_expired_token_without_a_message_ends_its_stream_at_the_next_check(
    api, stack, token, restart_after
):
    """No message says it: the web process's periodic check of its streams'
    tokens (``LMSP_STREAM_ACCESS_CHECK_SECONDS``, 2 s on the test stack) ends it."""
    stack.pause_worker()
    task, follower = _queued_follower(api, stack, token)
    expired_at = time.monotonic()
    ApiToken.objects.filter(owner__username="alice").update(expires_at=timezone.now())
    _ended_within(follower, expired_at, 2 + 5)
    assert api.get(f"/lmsp/v1/tasks/{task['id']}/events").status_code == 401


def test_a_revoked_direct_chat_stream_ends_with_an_error_and_is_cancelled(stack, token):
    body = {
        "model": "smollm2:135m",
        "messages": [{"role": "user", "content": LONG_STORY}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
    }
    with stack.client(token) as api:
        with api.stream("POST", "/v1/chat/completions", json=body) as answer:
            assert answer.status_code == 200
            lines = answer.iter_lines()
            chunks = []
            while len(chunks) < 3:  # the answer is coming
                line = next(lines)
                if line.startswith("data: "):
                    chunks.append(json.loads(line.removeprefix("data: ")))
            revoked_at = time.monotonic()
            call_command("lmsp_token", "revoke", token)
            rest = [line for line in lines if line.startswith("data: ")]
            took = time.monotonic() - revoked_at
    assert took < 5, f"the stream ended {took:.1f} s after its token was revoked"
    assert rest[-1] != "data: [DONE]" and "data: [DONE]" not in rest
    error = json.loads(rest[-1].removeprefix("data: "))["error"]
    assert error["code"] == "unauthorized" and error["type"] == "authentication_error"
    task = Task.objects.get(response_id=chunks[0]["id"])
    deadline = time.monotonic() + 30
    while task.status not in FINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(0.1)
        task.refresh_from_db()
    assert task.status == "cancelled"  # nobody can read it any more


def test_a_revoked_token_gets_no_synchronous_answer(stack, token):
    """A synchronous request waiting for its answer when its token is revoked
    is answered 401, and its generation cancelled."""
    answers = {}

    def ask() -> None:
        with stack.client(token) as api:
            answers["answer"] = api.post(
                "/lmsp/v1/responses",
                json=request_body(LONG_STORY, max_output_tokens=400),
            )

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 120
    while not Task.objects.filter(last_event_id__gt=2).exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    call_command("lmsp_token", "revoke", token)
    asking.join(30)
    answer = answers["answer"]
    assert answer.status_code == 401 and answer.json()["code"] == "unauthorized"
    assert answer.headers["www-authenticate"].startswith("Bearer")
    task = Task.objects.get()
    deadline = time.monotonic() + 30
    while task.status not in FINAL_STATUSES and time.monotonic() < deadline:
        time.sleep(0.1)
        task.refresh_from_db()
    assert task.status == "cancelled"
