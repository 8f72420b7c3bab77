"""The OpenAI adapter's pure translations, without a stack: requests into LMSP
requests (and LMSP's field names back), LMSP events into OpenAI's."""

from __future__ import annotations

import pytest

from lmsp_core import protocol
from lmsp_core.errors import ProblemError, problem
from openai_app import chat, responses
from responses_app.serializers import validate_response_request

RESPONSE_ID = "resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF"


def lmsp_events() -> list[tuple[str, dict]]:
    """A message and a function call, as a worker logs them."""
    message = protocol.message_item("msg_1", "Hi there")
    call = protocol.function_call_item("fc_1", "call_1", "get_weather", '{"city":"Paris"}')
    return [
        protocol.created_event(RESPONSE_ID),
        protocol.item_added_event(RESPONSE_ID, 0, protocol.message_item("msg_1", None)),
        protocol.text_delta_event(RESPONSE_ID, "msg_1", "Hi "),
        protocol.text_delta_event(RESPONSE_ID, "msg_1", "there"),
        protocol.item_done_event(RESPONSE_ID, 0, message),
        protocol.item_added_event(RESPONSE_ID, 1, {**call, "arguments": ""}),
        protocol.arguments_delta_event(RESPONSE_ID, "fc_1", call["arguments"]),
        protocol.item_done_event(RESPONSE_ID, 1, call),
        protocol.completed_event(RESPONSE_ID, protocol.usage(10, 5)),
    ]


def test_chat_messages_become_lmsp_items_that_validate():
    translated = chat.lmsp_request(
        {
            "model": "smollm2:135m",
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": "{}"},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "17 C"},
            ],
            "max_tokens": 20,
            "tools": [{"type": "function", "function": {"name": "get_weather"}}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        }
    )
    validated = validate_response_request(translated.request)
    assert [item["type"] for item in validated["input"]] == [
        "message",
        "message",
        "function_call",
        "function_call_output",
    ]
    assert validated["input"][0]["role"] == "system"
    assert validated["max_output_tokens"] == 20 and validated["store"] is False
    assert validated["tool_choice"] == {"type": "function", "name": "get_weather"}
    # LMSP's field names, as the chat request spelled them
    assert translated.param_of("input[3].output") == "messages[3]"
    assert translated.param_of("max_output_tokens") == "max_tokens"
    assert translated.param_of("tools[0].parameters") == "tools[0].function.parameters"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"n": 3}, "n"),
        ({"logprobs": True}, "logprobs"),
        ({"top_p": 0.5}, "top_p"),
        ({"seed": 1}, "seed"),
        ({"stop": ["\n"]}, "stop"),
        ({"store": True}, "store"),
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"response_format": {"type": "json_object"}}, "response_format.type"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_chat_refuses_what_it_cannot_honour(extra, param):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(ProblemError) as raised:
        chat.lmsp_request(body)
    assert raised.value.status == 400 and raised.value.param == param


def test_neutral_values_and_nulls_are_accepted():
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "n": 1,
        "top_p": 1,
        "logprobs": False,
        "seed": None,
    }
    assert chat.lmsp_request(body).request["input"][0]["role"] == "user"


def test_chat_chunks_of_a_stream():
    chunks = chat.ChunkTranslator(RESPONSE_ID, 1, "m", include_usage=True)
    out = [chunk for name, data in lmsp_events() for chunk in chunks.translate(name, data)]
    deltas = [chunk["choices"][0]["delta"] for chunk in out if chunk["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert "".join(delta.get("content", "") for delta in deltas) == "Hi there"
    calls = [call for delta in deltas for call in delta.get("tool_calls", [])]
    assert calls[0]["id"] == "call_1" and {call["index"] for call in calls} == {0}
    assert out[-2]["choices"][0]["finish_reason"] == "tool_calls"
    assert out[-1]["choices"] == [] and out[-1]["usage"]["total_tokens"] == 15


def test_a_stream_cut_short_ends_with_an_error_in_both_shapes():
    """The ``error`` event that ends a stream which could not get to its end
    (its events gone, its token revoked) becomes OpenAI's error, never an end."""
    cut = {"error": problem("event_history_expired", "Events were removed.")}
    chunks = chat.ChunkTranslator(RESPONSE_ID, 1, "m")
    assert chunks.translate("error", cut) == [
        {
            "error": {
                "message": "Events were removed.",
                "type": "invalid_request_error",
                "param": None,
                "code": "event_history_expired",
            }
        }
    ]
    translator = responses.EventTranslator(base={"id": RESPONSE_ID, "output": []})
    [(kind, data)] = translator.translate("error", cut)
    assert kind == "error" and data["code"] == "event_history_expired"


def test_responses_events_are_numbered_the_same_on_every_replay():
    base = {"id": RESPONSE_ID, "object": "response", "output": [], "status": "in_progress"}

    def translate() -> list[tuple[str, dict]]:
        translator = responses.EventTranslator(base=base)
        return [out for name, data in lmsp_events() for out in translator.translate(name, data)]

    first, again = translate(), translate()
    assert first == again
    assert [data["sequence_number"] for _, data in first] == list(range(len(first)))
    kinds = [kind for kind, _ in first]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    final = first[-1][1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0] == {
        "type": "output_text",
        "text": "Hi there",
        "annotations": [],
    }
    assert final["usage"]["total_tokens"] == 15


def test_responses_request_names_fields_as_sent():
    translated = responses.lmsp_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": "hi"}],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
        }
    )
    assert translated.request["store"] is True  # OpenAI's default
    assert translated.request["input"][0]["role"] == "system"
    assert translated.param_of("input[1].content[0].type") == "input[0].content[0].type"
    assert translated.param_of("request.input[0]") == "instructions"
    assert translated.param_of("response_format.json_schema.schema") == "text.format.schema"
