"""Durable tasks end to end: the tasks API, resumable event streams, retention,
cancellation and idempotency, on the real stack."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from generation.registry import get_model
from responses_app.models import Response
from responses_app.serializers import validate_response_request
from tasks_app.idempotency import fingerprint
from tasks_app.models import IdempotencyKey, Task

from .conftest import LONG_STORY, deltas_text, make_token, parse_sse, request_body, user_message

pytestmark = pytest.mark.e2e

FINAL = {"completed", "incomplete", "failed", "cancelled"}


def create_task(api, **extra) -> dict:
    answer = api.post("/lmsp/v1/tasks", json={"type": "response", "request": request_body(**extra)})
    assert answer.status_code == 202, answer.text
    return answer.json()


def wait_for(api, task_id: str, statuses=FINAL, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        task = api.get(f"/lmsp/v1/tasks/{task_id}").json()
        if task["status"] in statuses:
            return task
        time.sleep(0.1)
    raise AssertionError(f"task {task_id} still {task['status']} after {timeout}s")


def wait_for_events(task_id: str, count: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while Task.objects.get(id=task_id).last_event_id < count:
        assert time.monotonic() < deadline, "the task produced no events"
        time.sleep(0.05)


def read_events(api, task_id: str, **kwargs) -> list[dict]:
    with api.stream("GET", f"/lmsp/v1/tasks/{task_id}/events", **kwargs) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        return parse_sse("".join(answer.iter_text()))


def assert_one_contiguous_stream(events: list[dict], task: dict) -> None:
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] == f"response.{task['status']}"
    message = task["result"]["output"][0]
    assert deltas_text(events) == message["content"][0]["text"]


# --- the API -----------------------------------------------------------------------


def test_task_is_created_listed_and_finished(api):
    answer = api.post(
        "/lmsp/v1/tasks", json={"type": "response", "request": request_body(stream=True)}
    )
    assert answer.status_code == 202
    task = answer.json()
    assert answer.headers["Location"] == f"/lmsp/v1/tasks/{task['id']}"
    assert task["object"] == "task" and task["type"] == "response"
    assert task["id"].startswith("task_") and task["response_id"].startswith("resp_")
    assert task["status"] in ("queued", "in_progress") and task["result"] is None
    assert task["first_available_event_id"] == 1 and task["last_event_id"] >= 1
    done = wait_for(api, task["id"])
    assert done["status"] in ("completed", "incomplete")
    assert done["result"]["id"] == task["response_id"]
    assert done["result"]["status"] == done["status"]
    assert done["started_at"] >= done["created_at"] and done["completed_at"] >= done["started_at"]
    assert done["error"] is None


def test_task_list_pages_newest_first_and_filters_by_status(api):
    ids = [create_task(api, max_output_tokens=2)["id"] for _ in range(3)]
    for task_id in ids:
        wait_for(api, task_id)
    first = api.get("/lmsp/v1/tasks", params={"limit": 2}).json()
    assert first["object"] == "list" and first["has_more"] is True
    assert [t["id"] for t in first["data"]] == sorted(ids, reverse=True)[:2]
    assert first["next_cursor"] == first["data"][-1]["id"]
    rest = api.get("/lmsp/v1/tasks", params={"limit": 2, "after": first["next_cursor"]}).json()
    assert [t["id"] for t in rest["data"]] == sorted(ids, reverse=True)[2:]
    assert rest["has_more"] is False and rest["next_cursor"] is None
    incomplete = api.get("/lmsp/v1/tasks", params={"status": "incomplete"}).json()["data"]
    assert {t["id"] for t in incomplete} == set(ids)
    assert api.get("/lmsp/v1/tasks", params={"status": "queued"}).json()["data"] == []
    for params in ({"limit": 0}, {"limit": 101}, {"limit": "x"}, {"status": "done"}):
        problem = api.get("/lmsp/v1/tasks", params=params)
        assert problem.status_code == 400, params
        assert problem.json()["code"] == "invalid_request"


def test_task_request_is_validated_when_posted(api):
    for body, param, code in [
        ({"type": "response", "request": {"model": "smollm2:135m"}}, "request.input", 400),
        ({"type": "story", "request": request_body()}, "type", 400),
        ({"type": "response", "request": request_body(model="nope")}, "request.model", 404),
        ({"type": "response", "request": request_body(), "x": 1}, "x", 400),
    ]:
        answer = api.post("/lmsp/v1/tasks", json=body)
        assert answer.status_code == code, answer.text
        assert answer.headers["content-type"] == "application/problem+json"
        assert answer.json()["param"] == param
    assert not Task.objects.exists()


def test_other_owners_tasks_are_not_found(api, stack):
    task = create_task(api, max_output_tokens=2)
    with stack.client(make_token("mallory")) as other:
        for method, path in [
            ("GET", f"/lmsp/v1/tasks/{task['id']}"),
            ("POST", f"/lmsp/v1/tasks/{task['id']}/cancel"),
            ("GET", f"/lmsp/v1/tasks/{task['id']}/events"),
        ]:
            answer = other.request(method, path)
            assert answer.status_code == 404, (method, path)
            assert answer.json()["code"] == "task_not_found"
        assert other.get("/lmsp/v1/tasks").json()["data"] == []


# --- resuming event streams ----------------------------------------------------------


def test_resume_points_replay_exactly_the_later_events(api):
    task = wait_for(api, create_task(api, max_output_tokens=8)["id"])
    everything = read_events(api, task["id"])
    assert_one_contiguous_stream(everything, task)
    last = everything[-1]["id"]
    assert read_events(api, task["id"], params={"after": 3}) == everything[3:]
    assert read_events(api, task["id"], headers={"Last-Event-ID": "2"}) == everything[2:]
    both = read_events(api, task["id"], params={"after": 4}, headers={"Last-Event-ID": "1"})
    assert both == everything[4:]  # after wins
    for params, headers in [
        ({"after": "abc"}, {}),
        ({"after": "-1"}, {}),
        ({"after": "1.5"}, {}),
        ({}, {"Last-Event-ID": "x"}),
    ]:
        answer = api.get(f"/lmsp/v1/tasks/{task['id']}/events", params=params, headers=headers)
        assert answer.status_code == 400
        assert answer.json()["code"] == "invalid_request"
        assert answer.json()["param"] == ("after" if params else "Last-Event-ID")
    for resume in (last, last + 5):
        answer = api.get(f"/lmsp/v1/tasks/{task['id']}/events", params={"after": resume})
        assert answer.status_code == 204 and answer.content == b""


def test_pruned_history_answers_410_and_the_task_keeps_its_result(api):
    task = wait_for(api, create_task(api, max_output_tokens=4)["id"])
    call_command("lmsp_prune_events", "--older-than", "0")
    answer = api.get(f"/lmsp/v1/tasks/{task['id']}/events", params={"after": 0})
    assert answer.status_code == 410
    problem = answer.json()
    assert answer.headers["content-type"] == "application/problem+json"
    assert problem["code"] == "event_history_expired"
    assert problem["first_available_event_id"] is None
    assert problem["task_status"] == task["status"]
    assert problem["task_url"] == f"/lmsp/v1/tasks/{task['id']}"
    kept = api.get(f"/lmsp/v1/tasks/{task['id']}").json()
    assert kept["result"] == task["result"]
    assert kept["first_available_event_id"] is None
    assert kept["last_event_id"] == task["last_event_id"]
    # nothing was missed by a client that had seen everything
    assert (
        api.get(
            f"/lmsp/v1/tasks/{task['id']}/events", params={"after": task["last_event_id"]}
        ).status_code
        == 204
    )


def test_fifty_live_readers_each_get_every_event_once_in_order(api, stack, token):
    from concurrent.futures import ThreadPoolExecutor

    task = create_task(api, max_output_tokens=40)

    def reader(_: int) -> list[dict]:
        with stack.client(token) as client:
            return read_events(client, task["id"])

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(reader, range(50)))
    final = wait_for(api, task["id"])
    for events in results:
        assert_one_contiguous_stream(events, final)
        assert events == results[0]
    assert results[0][-1]["id"] == final["last_event_id"]


# --- cancellation ------------------------------------------------------------------


# How many tokens a running generation may still write once its cancel is
# posted: the flush interval's steps and the announcement's, with room for a
# loaded machine (a step of the batch of 8 takes about 70 ms here).
CANCEL_WITHIN_TOKENS = 16


def test_cancel_running_queued_and_final_tasks(api):
    running = create_task(api, input=[user_message(LONG_STORY)], max_output_tokens=400)
    # the rest of the worker's batch, so that the next task has to wait
    for _ in range(get_model("smollm2:135m").max_batch - 1):
        create_task(api, input=[user_message(LONG_STORY)], max_output_tokens=400)
    queued = create_task(api, max_output_tokens=4)
    wait_for_events(running["id"], 4)
    assert api.get(f"/lmsp/v1/tasks/{queued['id']}").json()["status"] == "queued"

    answer = api.post(f"/lmsp/v1/tasks/{queued['id']}/cancel")
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    events = read_events(api, queued["id"])
    assert [e["event"] for e in events] == ["response.created", "response.cancelled"]

    # The tokens written by the flush before the cancel: the cancel lands mid-
    # generation, far from the token limit, and stops it within a few tokens
    # (the steps of one flush interval and the cancel's announcement).
    written = Task.objects.get(id=running["id"]).checkpoint["tokens"]
    assert 0 < written < 400 - CANCEL_WITHIN_TOKENS, f"the cancel came at token {written}"
    assert api.post(f"/lmsp/v1/tasks/{running['id']}/cancel").status_code == 200
    stopped = wait_for(api, running["id"], timeout=5)
    assert stopped["status"] == "cancelled"
    generated = stopped["result"]["usage"]["output_tokens"]
    assert written <= generated <= written + CANCEL_WITHIN_TOKENS, (written, generated)
    events = read_events(api, running["id"])
    assert events[-1]["event"] == "response.cancelled"
    assert deltas_text(events) == stopped["result"]["output"][0]["content"][0]["text"]

    again = api.post(f"/lmsp/v1/tasks/{running['id']}/cancel")
    assert again.status_code == 409 and again.json()["code"] == "task_not_cancellable"
    never_started = Task.objects.get(id=queued["id"])
    assert never_started.started_at is None and never_started.attempt == 0


# --- idempotency -----------------------------------------------------------------------


def test_retried_task_post_never_starts_a_second_generation(api):
    body = {"type": "response", "request": request_body(max_output_tokens=3)}
    headers = {"Idempotency-Key": "retry-me-1"}
    first = api.post("/lmsp/v1/tasks", json=body, headers=headers)
    second = api.post("/lmsp/v1/tasks", json=body, headers=headers)
    assert first.status_code == second.status_code == 202
    assert first.json()["id"] == second.json()["id"]
    assert Task.objects.count() == 1 and Response.objects.count() == 1
    other = {"type": "response", "request": request_body(max_output_tokens=4)}
    reused = api.post("/lmsp/v1/tasks", json=other, headers=headers)
    assert reused.status_code == 422 and reused.json()["code"] == "idempotency_key_reused"
    for bad in ("", "x" * 256, "caf\u00e9"):
        answer = api.post("/lmsp/v1/tasks", json=body, headers={"Idempotency-Key": bad.encode()})
        assert answer.status_code == 400 and answer.json()["param"] == "Idempotency-Key"
    wait_for(api, first.json()["id"])
    assert Task.objects.count() == 1


def test_key_of_a_request_still_being_accepted_is_in_use(api):
    # The first request with this key has claimed it but not yet committed its task.
    owner = get_user_model().objects.get(username="alice")
    body = request_body()
    IdempotencyKey.objects.create(
        owner=owner,
        key="in-flight",
        fingerprint=fingerprint("tasks", validate_response_request(dict(body))),
    )
    answer = api.post(
        "/lmsp/v1/tasks",
        json={"type": "response", "request": body},
        headers={"Idempotency-Key": "in-flight"},
    )
    assert answer.status_code == 409 and answer.json()["code"] == "idempotency_key_in_use"
    assert not Task.objects.exists()


def test_retried_response_posts_replay_the_first_generation(api):
    headers = {"Idempotency-Key": "sync-1"}
    body = request_body(max_output_tokens=12, temperature=1.0)
    first = api.post("/lmsp/v1/responses", json=body, headers=headers)
    second = api.post("/lmsp/v1/responses", json=body, headers=headers)
    assert first.status_code == second.status_code == 200
    assert first.json() == second.json()
    assert Task.objects.count() == 1

    stream_headers = {"Idempotency-Key": "stream-1"}
    stream_body = request_body(max_output_tokens=12, temperature=1.0, stream=True)
    runs = []
    for _ in range(2):
        with api.stream(
            "POST", "/lmsp/v1/responses", json=stream_body, headers=stream_headers
        ) as a:
            assert a.status_code == 200
            runs.append(parse_sse("".join(a.iter_text())))
    assert runs[0] == runs[1]
    assert runs[0][0]["id"] == 1 and runs[0][-1]["event"] in (
        "response.completed",
        "response.incomplete",
    )
    assert Task.objects.count() == 2
