"""The OpenAI-compatible API end to end: the official ``openai`` package pointed
at the live stack (``base_url=<stack>/v1``, ``api_key=<lmsp token>``)."""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from tasks_app.models import Task

from .conftest import LONG_STORY, give_up_on, make_token, settled

pytestmark = pytest.mark.e2e

MODEL = "smollm2:135m"
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
# Constrained answers get room to finish their JSON.
SCHEMA_BUDGET = 300
FINAL = {"completed", "incomplete", "failed", "cancelled"}


def sdk(stack, token: str) -> OpenAI:
    # no retries: a test must see the first answer
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key=token, max_retries=0, timeout=120)


@pytest.fixture
def client(stack, token) -> OpenAI:
    return sdk(stack, token)


def wait_final(client: OpenAI, response_id: str, timeout: float = 120):  # noqa: ANN201
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = client.responses.retrieve(response_id)
        if response.status in FINAL:
            return response
        time.sleep(0.1)
    raise AssertionError(f"{response_id} still {response.status} after {timeout}s")


# --- models and errors ---------------------------------------------------------------


def test_models_list(client):
    models = list(client.models.list())
    assert MODEL in [model.id for model in models]
    assert all(model.object == "model" for model in models)
    assert client.models.retrieve(MODEL).id == MODEL


def test_bad_request_raises_bad_request_error_with_our_message(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=HELLO, n=2)
    error = raised.value
    assert error.status_code == 400
    assert error.param == "n" and error.code == "invalid_request"
    assert error.type == "invalid_request_error"
    assert "n: Only 1 is supported by this service." in error.message
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model=MODEL,
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}],
                }
            ],
        )
    assert raised.value.code == "unsupported_content_type"
    assert raised.value.param == "messages[0].content[0].type"
    with pytest.raises(openai.BadRequestError) as raised:  # LMSP's validation, renamed
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=0)
    assert raised.value.param == "max_tokens"
    assert raised.value.message.startswith("Error code: 400")
    assert "max_tokens: " in raised.value.message


def test_errors_have_openai_shape_and_status(stack, client, token):
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert raised.value.code == "model_not_found" and raised.value.param == "model"
    with pytest.raises(openai.AuthenticationError):
        sdk(stack, "lmsp_nope_nope").models.list()
    with httpx.Client(base_url=stack.base_url, headers={"Authorization": f"Bearer {token}"}) as raw:
        for method, path, status in (
            ("GET", "/v1/nothing/here", 404),
            ("GET", "/v1/chat/completions", 405),
            ("POST", "/v1/responses/resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF/cancel", 404),
        ):
            answer = raw.request(method, path)
            assert answer.status_code == status, answer.text
            assert answer.headers["content-type"] == "application/json"
            assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
        assert answer.json()["error"]["type"] == "not_found_error"
        answer = raw.post("/v1/chat/completions", content=b"{not json")
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "invalid_request"
        assert raw.get("/v1/chat/completions").headers["Allow"] == "POST"
        # answered below the views: a Host Django refuses, a body over the limit
        answer = raw.get("/v1/models", headers={"Host": "evil.example"})
        assert answer.status_code == 400
        assert answer.json()["error"]["type"] == "invalid_request_error"
        answer = raw.post("/v1/chat/completions", content=b" " * 1_000_001)
        assert answer.status_code == 413
        assert answer.json()["error"]["code"] == "payload_too_large"


# --- chat completions ----------------------------------------------------------------


def test_chat_sync_and_streamed_say_the_same(client):
    sync = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, max_tokens=24)
    [choice] = sync.choices
    assert sync.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    usage = sync.usage
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=HELLO,
            temperature=0,
            max_completion_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in with_choices)
    assert text == choice.message.content
    assert with_choices[-1].choices[0].finish_reason == choice.finish_reason
    assert (
        chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens
    )


def test_chat_required_tool_call_validates_and_round_trips(client):
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    answer = client.chat.completions.create(
        model=MODEL,
        messages=question,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=SCHEMA_BUDGET,
    )
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)

    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 17}'}
    after = client.chat.completions.create(
        model=MODEL,
        messages=[*question, choice.message.model_dump(exclude_none=True), result],
        tools=[WEATHER],
        tool_choice="none",
        temperature=0,
        max_tokens=40,
    )
    assert after.choices[0].message.content.strip()
    assert after.choices[0].message.tool_calls is None


def test_chat_streamed_tool_call_arrives_whole(client):
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the weather in Rome?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=SCHEMA_BUDGET,
            stream=True,
        )
    )
    calls = [
        call
        for chunk in chunks
        if chunk.choices
        for call in chunk.choices[0].delta.tool_calls or []
    ]
    assert calls[0].id.startswith("call_") and calls[0].function.name == "get_weather"
    assert {call.index for call in calls} == {0}
    arguments = "".join(call.function.arguments or "" for call in calls)
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "tool_calls"


def test_chat_json_schema_answer_validates(client):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 30},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person: a name and an age."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        temperature=0,
        max_tokens=SCHEMA_BUDGET,
    )
    assert answer.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)


def test_chat_stream_dropped_by_the_client_cancels_the_generation(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG_STORY}],
        temperature=0,
        max_tokens=200,  # never reached: the client leaves after a few chunks
        stream=True,
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 4:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while Task.objects.get(response_id=chunks[0].id).status != "cancelled":
        assert time.monotonic() < deadline, "the generation went on without a reader"
        time.sleep(0.1)


def test_a_synchronous_chat_client_that_gives_up_cancels_its_generation(client, stack, token):
    """A client that leaves a non-streamed completion takes its generation with
    it, as it did under Django's handler (``lmsp_core.lean`` cancels the view)."""
    client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=1)  # loaded, and gone
    request = {
        "model": MODEL,
        "messages": [{"role": "user", "content": LONG_STORY}],
        "temperature": 0,
        "max_tokens": 400,  # never reached: the client gives up after 3 s
    }
    gave_up = give_up_on(stack, token, "/v1/chat/completions", request)
    task = settled(Task.objects.get(), gave_up)
    assert task.status == "cancelled" and task.started_at is not None
    assert time.monotonic() - gave_up < 2


# --- responses -------------------------------------------------------------------------


def test_responses_sync_and_streamed(client):
    sync = client.responses.create(
        model=MODEL,
        input="Say hello in one short sentence.",
        temperature=0,
        max_output_tokens=24,
        store=False,
    )
    assert sync.id.startswith("resp_") and sync.object == "response"
    assert sync.status in ("completed", "incomplete") and sync.output_text.strip()
    assert sync.usage.total_tokens == sync.usage.input_tokens + sync.usage.output_tokens

    events = list(
        client.responses.create(
            model=MODEL,
            input=[{"role": "user", "content": "Say hello in one short sentence."}],
            temperature=0,
            max_output_tokens=24,
            store=False,
            stream=True,
        )
    )
    types = [event.type for event in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == f"response.{sync.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == sync.output_text
    assert events[-1].response.output_text == sync.output_text
    assert "response.output_text.done" in types and "response.content_part.added" in types


def test_responses_json_schema_and_conversation(client):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"],
        "additionalProperties": False,
    }
    first = client.responses.create(
        model=MODEL,
        instructions="Answer with JSON.",
        input="Name a city in France.",
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
        temperature=0,
        max_output_tokens=SCHEMA_BUDGET,
    )
    assert first.status == "completed" and first.store is True
    jsonschema.validate(json.loads(first.output_text), schema)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=MODEL,
        input="Say it again.",
        previous_response_id=first.id,
        temperature=0,
        max_output_tokens=30,
    )
    assert second.previous_response_id == first.id and second.output_text.strip()


def test_responses_tool_call_output_items_go_back_as_input(client):
    """The agent loop: the output items, as the SDK parsed them, sent back
    with the tool's result."""
    tool = {"type": "function", **WEATHER["function"]}
    question = [{"role": "user", "content": "What is the weather in Oslo?"}]
    first = client.responses.create(
        model=MODEL,
        input=question,
        tools=[tool],
        tool_choice="required",
        temperature=0,
        max_output_tokens=SCHEMA_BUDGET,
        store=False,
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "17 C"}
    second = client.responses.create(
        model=MODEL,
        input=[*question, *first.output, result],
        tools=[tool],
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
        store=False,
    )
    assert second.output[0].type == "message" and second.output_text.strip()


def test_background_stream_resumes_after_a_drop_exactly_once(client, stack):
    stream = client.responses.create(
        model=MODEL,
        input=LONG_STORY,
        temperature=0,
        max_output_tokens=60,
        background=True,
        stream=True,
    )
    seen = []
    for event in stream:
        seen.append(event)
        if len(seen) == 6:
            break
    stream.close()  # dropped: a background response goes on
    response_id = seen[0].response.id
    assert seen[0].response.background is True

    rest = list(
        client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number)
    )
    events = seen + rest
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[-1].type in ("response.completed", "response.incomplete")
    final = client.responses.retrieve(response_id)
    assert final.status == events[-1].response.status and final.background is True
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text

    # the same response is nobody else's
    stranger = sdk(stack, make_token("mallory"))
    with pytest.raises(openai.NotFoundError):
        stranger.responses.retrieve(response_id)


def test_background_response_is_cancelled(client):
    started = client.responses.create(
        model=MODEL,
        input=LONG_STORY,
        temperature=0,
        max_output_tokens=200,  # never reached: cancelled at once
        background=True,
    )
    assert started.status in ("queued", "in_progress") and started.background is True
    client.responses.cancel(started.id)
    final = wait_final(client, started.id)
    assert final.status == "cancelled"
    events = list(client.responses.retrieve(started.id, stream=True))
    # OpenAI defines no event for this: the SDK gives it untyped, as it should
    assert events[-1].type == "response.cancelled"
    assert events[-1].to_dict()["response"]["status"] == "cancelled"
    with pytest.raises(openai.ConflictError):
        client.responses.cancel(started.id)
