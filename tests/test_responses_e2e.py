"""POST /responses end to end: web process, Celery worker, SmolLM2, PostgreSQL, Redis."""

from __future__ import annotations

import re
import time

import pytest

from generation.registry import get_model
from responses_app.models import Response
from responses_app.prompting import prompt_of
from tasks_app.models import Event, UsageRecord
from workers.loading import load_tokenizer

from .conftest import LONG_STORY, deltas_text, give_up_on, parse_sse, request_body, settled

pytestmark = pytest.mark.e2e


def test_synchronous_response_is_completed_text_with_consistent_usage(api):
    answer = api.post("/lmsp/v1/responses", json=request_body(max_output_tokens=60, store=True))
    assert answer.status_code == 200, answer.text
    assert answer.headers["LMSP-Version"] == "1.0"
    body = answer.json()
    assert body["object"] == "response"
    assert body["id"].startswith("resp_") and len(body["id"]) == 31
    assert body["status"] == "completed"
    assert body["error"] is None and body["incomplete_details"] is None
    [message] = body["output"]
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["id"].startswith("msg_")
    text = message["content"][0]["text"]
    assert message["content"][0]["type"] == "output_text" and text.strip()
    usage = body["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    spec = get_model("smollm2:135m")
    prompt = prompt_of(Response.objects.get(id=body["id"]), spec)
    tokenizer = load_tokenizer(spec)
    assert usage["input_tokens"] == len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    # the answer's own tokens, plus the end-of-turn token that ended it
    assert usage["output_tokens"] == len(tokenizer(text, add_special_tokens=False)["input_ids"]) + 1


def test_token_limit_makes_the_response_incomplete(api):
    body = api.post(
        "/lmsp/v1/responses",
        json=request_body("Write a long story about a dragon.", max_output_tokens=5),
    ).json()
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["output_tokens"] == 5
    assert body["output"][0]["content"][0]["text"]


def test_stream_has_contiguous_ids_and_deltas_that_make_the_text(api):
    with api.stream(
        "POST", "/lmsp/v1/responses", json=request_body(stream=True, max_output_tokens=24)
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        assert answer.headers["cache-control"] == "no-cache"
        raw = "".join(answer.iter_text())  # returns only once the server closes
    events = parse_sse(raw)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[0]["event"] == "response.created"
    assert events[0]["data"]["status"] == "in_progress"
    assert events[1]["event"] == "response.output_item.added"
    final = events[-1]
    assert final["event"] in ("response.completed", "response.incomplete")
    assert sum(e["event"] in ("response.completed", "response.incomplete") for e in events) == 1
    done = [e for e in events if e["event"] == "response.output_item.done"]
    assert len(done) == 1
    item = done[0]["data"]["item"]
    assert done[0]["data"]["output_index"] == events[1]["data"]["output_index"] == 0
    assert deltas_text(events, item["id"]) == item["content"][0]["text"]
    usage = final["data"]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    response_ids = {e["data"]["response_id"] for e in events}
    assert len(response_ids) == 1


def test_dropped_stream_cancels_within_a_second_and_frees_the_worker(api):
    request = request_body(LONG_STORY, stream=True, store=True, max_output_tokens=400)
    with api.stream("POST", "/lmsp/v1/responses", json=request) as answer:
        seen = []
        for line in answer.iter_lines():
            if line.startswith("data: ") and '"delta"' in line:
                seen.append(line)
            if line.startswith("data: ") and "response_id" in line and not seen:
                response_id = line.split('"response_id":"')[1].split('"')[0]
            if len(seen) >= 3:
                break
    dropped_at = time.monotonic()
    while time.monotonic() - dropped_at < 5:
        status = Response.objects.get(id=response_id).status
        if status != "in_progress":
            break
        time.sleep(0.05)
    elapsed = time.monotonic() - dropped_at
    assert status == "cancelled"
    assert elapsed < 1.0, f"cancelled after {elapsed:.2f}s"
    stored = Response.objects.get(id=response_id)
    assert stored.output[0]["content"][0]["text"]  # the partial text is kept
    started = time.monotonic()
    follow_up = api.post("/lmsp/v1/responses", json=request_body(max_output_tokens=4))
    assert follow_up.status_code == 200 and follow_up.json()["status"] in (
        "completed",
        "incomplete",
    )
    assert time.monotonic() - started < 20


def test_store_false_leaves_nothing_behind(api):
    body = api.post("/lmsp/v1/responses", json=request_body(max_output_tokens=4)).json()
    assert body["status"] in ("completed", "incomplete")
    assert not Response.objects.filter(id=body["id"]).exists()
    assert not Event.objects.filter(task__response_id=body["id"]).exists()
    assert api.get(f"/lmsp/v1/responses/{body['id']}").status_code == 404
    usage = UsageRecord.objects.get(response_id=body["id"])  # only the accounting stays
    assert (usage.status, usage.output_tokens) == (body["status"], body["usage"]["output_tokens"])


def test_queue_waits_are_kept_alive_with_comments(api):
    """The stack sends a keep-alive comment after 1 s of quiet (15 s in
    production); while the request waits in the queue it is ``: queued N``."""
    slots = get_model("smollm2:135m").max_batch  # fill the worker's batch
    busy = [
        api.post(
            "/lmsp/v1/tasks",
            json={"type": "response", "request": request_body(LONG_STORY, max_output_tokens=60)},
        ).json()
        for _ in range(slots)
    ]
    with api.stream(
        "POST", "/lmsp/v1/responses", json=request_body(stream=True, max_output_tokens=4)
    ) as answer:
        raw = "".join(answer.iter_text())
    before_output = raw.split("response.output_item.added")[0]
    assert re.search(r"^: (keep-alive|queued [0-9]+)$", before_output, re.M)  # while queued
    events = parse_sse(raw)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    for task in busy:
        assert api.get(f"/lmsp/v1/tasks/{task['id']}").json()["status"] != "queued"


def test_a_synchronous_client_that_gives_up_cancels_its_generation(api, stack, token):
    assert api.post("/lmsp/v1/responses", json=request_body(max_output_tokens=1)).status_code == 200
    request = request_body(LONG_STORY, store=True, max_output_tokens=400)
    gave_up = give_up_on(stack, token, "/lmsp/v1/responses", request)
    response = settled(Response.objects.get(), gave_up)
    assert response.status == "cancelled"
    assert time.monotonic() - gave_up < 2
