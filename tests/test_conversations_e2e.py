"""Stored responses and conversations end to end: previous_response_id chains
with tool calls, what the model saw, the admin's view of it, and what
``store: false`` leaves behind."""

from __future__ import annotations

import time

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from django.utils.html import escape

from generation.registry import get_model
from lmsp_core.ids import new_id
from responses_app.models import Response
from responses_app.prompting import prompt_of
from tasks_app.models import Event, Task

from .conftest import make_token, output_text, parse_sse, request_body, user_message

pytestmark = pytest.mark.e2e


def assert_in_order(text: str, parts: list[str]) -> None:
    """Each part occurs after the one before it (parts may repeat, e.g. two
    identical greedy answers)."""
    at = 0
    for part in parts:
        found = text.find(part, at)
        assert found >= 0, f"{part!r} not found after position {at} in:\n{text}"
        at = found + len(part)


def post(api, body: dict) -> dict:
    answer = api.post("/lmsp/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_three_turns_with_a_tool_call_reach_the_model_and_the_admin_in_order(api):
    system = {
        "type": "message",
        "role": "system",
        "content": [{"type": "input_text", "text": "You are a weather assistant named Nimbus."}],
    }
    first = post(
        api,
        request_body(
            "My name is Ada and I live in Oslo.",
            store=True,
            max_output_tokens=12,
        )
        | {"input": [system, user_message("My name is Ada and I live in Oslo.")]},
    )
    call = {
        "type": "function_call",
        "call_id": "call_weather_1",
        "name": "get_weather",
        "arguments": '{"city":"Oslo"}',
    }
    result = {
        "type": "function_call_output",
        "call_id": "call_weather_1",
        "output": '{"temperature_c":17,"condition":"light rain"}',
    }
    # The call and its result come back as input items, as a client sends them
    # after running the tool (no tool definitions needed to continue).
    second = post(
        api,
        request_body(
            store=True,
            max_output_tokens=12,
            previous_response_id=first["id"],
        )
        | {"input": [call, result]},
    )
    third = post(
        api,
        request_body(
            "What is my name, and should I take an umbrella?",
            store=True,
            max_output_tokens=12,
            previous_response_id=second["id"],
        ),
    )
    assert third["previous_response_id"] == second["id"]
    for response in (first, second, third):
        assert response["status"] in ("completed", "incomplete")
        assert output_text(response).strip()

    # the model saw the whole history, in order
    prompt = prompt_of(Response.objects.get(id=third["id"]), get_model("smollm2:135m"))
    history = [
        "You are a weather assistant named Nimbus.",
        "My name is Ada and I live in Oslo.",
        output_text(first).strip(),
        '"name": "get_weather"',
        '"city": "Oslo"',
        '{"temperature_c":17,"condition":"light rain"}',
        output_text(second).strip(),
        "What is my name, and should I take an umbrella?",
    ]
    assert_in_order(prompt, history)
    assert prompt.count("My name is Ada") == 1  # the chain is not repeated
    # and it counted: the third turn's input is the largest
    assert third["usage"]["input_tokens"] > second["usage"]["input_tokens"]
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]

    # the admin shows the same conversation, in the same order
    staff = get_user_model().objects.create_superuser("root", password="unused")
    browser = Client()
    browser.force_login(staff)
    page = browser.get(reverse("admin:responses_app_response_change", args=[quote(third["id"])]))
    assert page.status_code == 200
    html = page.content.decode()
    chat = html[html.index('id="conversation"') : html.index('id="timeline"')]
    shown = [
        first["id"],
        "You are a weather assistant named Nimbus.",
        "My name is Ada and I live in Oslo.",
        escape(output_text(first).strip()),
        second["id"],
        "get_weather",
        "&quot;city&quot;: &quot;Oslo&quot;",
        "&quot;temperature_c&quot;: 17",
        escape(output_text(second).strip()),
        third["id"],
        "What is my name, and should I take an umbrella?",
    ]
    assert_in_order(chat, shown)
    assert "response.completed" in html or "response.incomplete" in html


def gone(response_id: str, timeout: float = 10) -> bool:
    """Whether nothing of the response is left (the stream path deletes right
    after its last frame is sent, so the client may get there first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not (
            Response.objects.filter(id=response_id).exists()
            or Task.objects.filter(response_id=response_id).exists()
            or Event.objects.filter(data__contains=response_id).exists()
        ):
            return True
        time.sleep(0.2)
    return False


def test_unstored_responses_leave_nothing_in_the_database(api):
    synchronous = post(api, request_body())  # store defaults to false
    assert synchronous["store"] is False and synchronous["status"] in ("completed", "incomplete")
    with api.stream("POST", "/lmsp/v1/responses", json=request_body(stream=True)) as answer:
        assert answer.status_code == 200
        events = parse_sse("".join(answer.iter_text()))
    streamed = events[0]["data"]["response_id"]
    for response_id in (synchronous["id"], streamed):
        assert gone(response_id)
        answer = api.get(f"/lmsp/v1/responses/{response_id}")
        assert answer.status_code == 404 and answer.json()["code"] == "response_not_found"


def test_unknown_and_foreign_responses_are_not_found(api, stack):
    unknown = api.get(f"/lmsp/v1/responses/{new_id('resp')}")
    assert unknown.status_code == 404
    assert unknown.headers["content-type"] == "application/problem+json"
    assert unknown.json()["code"] == "response_not_found"

    mine = post(api, request_body(store=True))
    assert api.get(f"/lmsp/v1/responses/{mine['id']}").json()["id"] == mine["id"]
    with stack.client(make_token("bob")) as bob:
        foreign = bob.get(f"/lmsp/v1/responses/{mine['id']}")
        assert foreign.status_code == 404 and foreign.json()["code"] == "response_not_found"
        continued = bob.post(
            "/lmsp/v1/responses", json=request_body(previous_response_id=mine["id"])
        )
        assert continued.status_code == 404
        assert continued.json()["code"] == "response_not_found"
        assert continued.json()["param"] == "previous_response_id"
