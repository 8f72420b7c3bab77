"""One model worker serves many requests at once, through HTTP on the real
stack: batched greedy answers equal the answers alone, grammars and free text
share a batch, a cancel touches one request only, and a worker killed with a
full batch loses nothing."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import pytest

from tasks_app.models import Event, Task

from .conftest import deltas_text, parse_sse, request_body
from .test_tasks_e2e import assert_one_contiguous_stream, create_task, read_events, wait_for

pytestmark = pytest.mark.e2e

PROMPTS = [
    "Name a colour.",
    "Say hello in French.",
    "What is two plus two?",
    "Name a large animal.",
    "Give me a word that rhymes with cat.",
    "Name a planet.",
    "Say something about the sea.",
    "Name a fruit that is yellow.",
]
TOKENS = 24
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}


def stream_answer(stack, token: str, body: dict, log: dict) -> None:
    """A streamed response's text and when its first and last deltas arrived."""
    with stack.client(token) as client:
        with client.stream("POST", "/lmsp/v1/responses", json={**body, "stream": True}) as answer:
            assert answer.status_code == 200
            raw = ""
            for chunk in answer.iter_text():
                raw += chunk
                if "output_text.delta" in chunk:
                    log.setdefault("first", time.monotonic())
                    log["last"] = time.monotonic()
    events = parse_sse(raw)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    log["text"] = deltas_text(events)
    log["final"] = events[-1]["event"]


@pytest.fixture(scope="module")
def alone(stack, django_db_blocker) -> dict[str, str]:
    """Each prompt's greedy answer when it runs by itself."""
    from .conftest import make_token

    with django_db_blocker.unblock():
        token = make_token("batching-alone")
    answers = {}
    for prompt in PROMPTS:
        log: dict = {}
        stream_answer(stack, token, request_body(prompt, max_output_tokens=TOKENS), log)
        answers[prompt] = log["text"]
    return answers


def test_eight_concurrent_greedy_streams_equal_their_answers_alone(stack, token, alone):
    logs = [{} for _ in PROMPTS]
    threads = [
        threading.Thread(
            target=stream_answer,
            args=(stack, token, request_body(prompt, max_output_tokens=TOKENS), log),
        )
        for prompt, log in zip(PROMPTS, logs, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert [log["text"] for log in logs] == [alone[prompt] for prompt in PROMPTS]
    # Served together: every stream had its first token before any stream ended
    # (one at a time, the eighth would start only after the seventh ended).
    assert max(log["first"] for log in logs) < min(log["last"] for log in logs)


def test_a_grammar_and_free_text_batched_together_are_both_valid(stack, token, alone):
    schema_body = request_body(
        "Invent a person.",
        max_output_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    constrained: dict = {}
    free: dict = {}
    threads = [
        threading.Thread(target=stream_answer, args=(stack, token, schema_body, constrained)),
        threading.Thread(
            target=stream_answer,
            args=(stack, token, request_body(PROMPTS[0], max_output_tokens=TOKENS), free),
        ),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert constrained["final"] == "response.completed"
    jsonschema.validate(json.loads(constrained["text"]), PERSON)
    assert free["text"] == alone[PROMPTS[0]]


def test_cancelling_one_of_eight_leaves_the_others_as_they_are(api, alone):
    tasks = [
        create_task(api, input=request_body(prompt)["input"], max_output_tokens=TOKENS)
        for prompt in PROMPTS
    ]
    victim = tasks[3]
    deadline = time.monotonic() + 120
    while not Event.objects.filter(
        task_id=victim["id"], type="response.output_text.delta"
    ).exists():
        assert time.monotonic() < deadline, "the task to cancel never started"
        time.sleep(0.02)
    assert api.post(f"/lmsp/v1/tasks/{victim['id']}/cancel").status_code == 200
    for prompt, task in zip(PROMPTS, tasks, strict=True):
        done = wait_for(api, task["id"], timeout=300)
        events = read_events(api, task["id"])
        if task is victim:
            assert done["status"] == "cancelled"
            assert len(deltas_text(events)) < len(alone[prompt])
        else:
            assert done["status"] in ("completed", "incomplete")
            assert deltas_text(events) == alone[prompt]


def test_a_worker_killed_with_a_full_batch_loses_nothing(api, stack, restart_after):
    tasks = [
        create_task(api, input=request_body(prompt)["input"], max_output_tokens=60)
        for prompt in PROMPTS
    ]
    ids = [task["id"] for task in tasks]
    deadline = time.monotonic() + 180
    while Task.objects.filter(id__in=ids, status="in_progress", last_event_id__gte=4).count() < 8:
        assert time.monotonic() < deadline, "the batch never filled"
        time.sleep(0.05)
    stack.worker.kill()  # SIGKILL with eight generations in flight
    assert Task.objects.filter(id__in=ids, status="in_progress").count() == 8
    stack.worker.start()
    for task_id in ids:
        done = wait_for(api, task_id, timeout=300)
        assert done["status"] in ("completed", "incomplete")
        assert_one_contiguous_stream(read_events(api, task_id), done)
    assert all(task.attempt == 2 for task in Task.objects.filter(id__in=ids))
