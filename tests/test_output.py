"""OutputAssembler on model text as thinking and tool-calling models write it.

Pure unit tests: no model, no database. The texts have the exact shape Qwen3
writes (a ``<think>`` block first, the answer after a blank line, Hermes
``<tool_call>`` blocks), the format the registry's ``qwen3:0.6b`` entry is
parsed with.
"""

from __future__ import annotations

import json

import pytest

from generation.output import OutputAssembler, opens_call
from generation.params import GenerationParams
from generation.registry import ModelSpec

THOUGHTS = (
    "Okay, the user is asking for the capital of France. I remember that Paris is the "
    "capital and largest city of France.\nLet me answer in one sentence."
)
ANSWER = "The capital of France is Paris."
THINKING = f"<think>\n{THOUGHTS}\n</think>\n\n{ANSWER}"
CALL = {"name": "get_weather", "arguments": {"city": "Hangzhou"}}
THINKING_THEN_CALL = (
    "<think>\nThe user wants the weather in Hangzhou; I should call get_weather.\n</think>\n\n"
    f"<tool_call>\n{json.dumps(CALL)}\n</tool_call>"
)


def assemble(chunks: list[str], **flags: bool) -> tuple[OutputAssembler, list[tuple[str, dict]]]:
    assembler = OutputAssembler("resp_test", **flags)
    events = []
    for chunk in chunks:
        events += assembler.feed(chunk)
    events += assembler.finish()
    return assembler, events


def deltas(events: list[tuple[str, dict]], kind: str, item_id: str) -> str:
    return "".join(
        body["delta"] for name, body in events if name == kind and body["item_id"] == item_id
    )


def summary(item: dict) -> str:
    return item["summary"][0]["text"]


def test_thoughts_become_a_reasoning_item_before_the_message():
    assembler, events = assemble([THINKING], parse_reasoning=True)
    reasoning, message = assembler.items
    assert reasoning["type"] == "reasoning" and reasoning["id"].startswith("rs_")
    assert reasoning["summary"] == [{"type": "summary_text", "text": THOUGHTS}]
    assert message["type"] == "message"
    assert message["content"][0]["text"] == ANSWER
    names = [name for name, _ in events]
    assert names == [
        "response.output_item.added",
        "response.reasoning_summary_text.delta",
        "response.output_item.done",
        "response.output_item.added",
        "response.output_text.delta",
        "response.output_item.done",
    ]
    assert [body["output_index"] for name, body in events if "output_item" in name] == [0, 0, 1, 1]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_markers_split_across_chunks(size):
    """Decoding hands over a few characters at a time; markers straddle chunks."""
    chunks = [THINKING[i : i + size] for i in range(0, len(THINKING), size)]
    assembler, events = assemble(chunks, parse_reasoning=True)
    reasoning, message = assembler.items
    assert summary(reasoning) == THOUGHTS
    assert message["content"][0]["text"] == ANSWER
    reasoning_deltas = deltas(events, "response.reasoning_summary_text.delta", reasoning["id"])
    assert reasoning_deltas == THOUGHTS
    assert deltas(events, "response.output_text.delta", message["id"]) == ANSWER
    assert not any("<" in body.get("delta", "") for _, body in events)


def test_every_two_chunk_split_gives_the_same_items():
    for cut in range(len(THINKING) + 1):
        assembler, _ = assemble([THINKING[:cut], THINKING[cut:]], parse_reasoning=True)
        assert [summary(assembler.items[0]), assembler.items[1]["content"][0]["text"]] == [
            THOUGHTS,
            ANSWER,
        ], cut


def test_state_restores_mid_thought_and_mid_marker():
    """A new attempt after a lost worker goes on from the saved state."""
    for cut in (3, 20, len("<think>\n") + len(THOUGHTS) + 4, len(THINKING) - 10):
        first = OutputAssembler("resp_test", parse_reasoning=True)
        events = first.feed(THINKING[:cut])
        saved = json.loads(json.dumps(first.compact_state()))  # as stored in the checkpoint
        second = OutputAssembler.restore("resp_test", saved, events)
        events += second.feed(THINKING[cut:]) + second.finish()
        reasoning, message = second.items
        assert summary(reasoning) == THOUGHTS, cut
        assert message["content"][0]["text"] == ANSWER, cut
        assert deltas(events, "response.output_text.delta", message["id"]) == ANSWER
        done = [body["item"] for name, body in events if name == "response.output_item.done"]
        assert done == second.items


def test_a_checkpoint_does_not_grow_with_the_answer():
    """The text is in the logged deltas; the checkpoint keeps only the skeleton."""
    assembler = OutputAssembler("resp_test")
    assembler.feed("Once upon a time ")
    early = json.dumps(assembler.compact_state())
    assembler.feed("there was a model that wrote a very long story. " * 50)
    assert len(json.dumps(assembler.compact_state())) == len(early)


def test_thinking_then_a_tool_call():
    chunks = [THINKING_THEN_CALL[i : i + 4] for i in range(0, len(THINKING_THEN_CALL), 4)]
    assembler, events = assemble(chunks, parse_reasoning=True, parse_tools=True)
    reasoning, call = assembler.items
    assert summary(reasoning).startswith("The user wants the weather")
    assert call["type"] == "function_call" and call["name"] == "get_weather"
    assert json.loads(call["arguments"]) == CALL["arguments"]
    assert call["id"].startswith("fc_") and call["call_id"].startswith("call_")
    assert not [e for e in events if e[0] == "response.output_text.delta"]


def test_empty_thoughts_leave_no_reasoning_item():
    """Qwen3 with thinking switched off still writes an empty think block."""
    assembler, events = assemble(["<think>\n\n</think>\n\n", ANSWER], parse_reasoning=True)
    [message] = assembler.items
    assert message["content"][0]["text"] == ANSWER
    assert not [e for e in events if e[0] == "response.reasoning_summary_text.delta"]


def test_thoughts_cut_by_the_token_limit_are_kept():
    assembler = OutputAssembler("resp_test", parse_reasoning=True)
    events = assembler.feed("<think>\nFirst, recall the facts.\nThen ") + assembler.close()
    [reasoning] = assembler.items
    assert summary(reasoning) == "First, recall the facts.\nThen"
    assert events[-1][0] == "response.output_item.done"


def test_without_the_reasoning_capability_think_is_plain_text():
    assembler, _ = assemble([THINKING])
    [message] = assembler.items
    assert message["content"][0]["text"] == THINKING


def test_think_is_only_a_marker_at_the_start():
    text = "Models may write <think> tags."
    assembler, _ = assemble(["Models may ", "write <think> tags."], parse_reasoning=True)
    [message] = assembler.items
    assert message["content"][0]["text"] == text


# --- a call the prompt opened (tool_choice required or a named tool) ------------------

FORCED = '{"name":"get_weather","arguments":{"city":"Hangzhou"}}'
SMOLLM2 = ModelSpec("smollm2:135m", "gguf-package", 8192, 4096, ("tools",))
QWEN3 = ModelSpec("qwen3:0.6b", "folder", 32768, 8192, ("tools", "reasoning"))
WEATHER_TOOL = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}


def forced_events(chunks: list[str]) -> tuple[OutputAssembler, list[tuple[str, dict]]]:
    params = GenerationParams(tools=[WEATHER_TOOL], tool_choice="required")
    assembler = OutputAssembler.for_generation("resp_test", params, SMOLLM2)
    events = []
    for chunk in chunks:
        events += assembler.feed(chunk)
    return assembler, events


@pytest.mark.parametrize("size", [1, 3, len(FORCED)])
def test_a_call_opened_by_the_prompt_is_the_same_call_as_a_tagged_one(size):
    """The output is the JSON alone, ended by the model: the same item and events."""
    assembler, events = forced_events([FORCED[i : i + size] for i in range(0, len(FORCED), size)])
    assert events == []  # no closing tag: the call is whole when the generation ends
    events += assembler.finish()
    [call] = assembler.items
    tagged, tagged_events = assemble([f"<tool_call>\n{FORCED}\n</tool_call>"], parse_tools=True)
    assert [name for name, _ in events] == [name for name, _ in tagged_events]
    assert {**call, "id": "", "call_id": ""} == {**tagged.items[0], "id": "", "call_id": ""}
    assert json.loads(call["arguments"]) == CALL["arguments"]
    assert (
        deltas(events, "response.function_call_arguments.delta", call["id"]) == (call["arguments"])
    )


def test_a_call_opened_by_the_prompt_and_cut_short_is_dropped():
    """The token limit inside the JSON: no call, and no markup or JSON as text."""
    assembler, events = forced_events([FORCED[:30]])
    events += assembler.close()
    assert assembler.items == [] and events == []
    assembler, events = forced_events([FORCED])  # whole, only the end token missing
    events += assembler.close()
    [call] = assembler.items
    assert call["type"] == "function_call"


def test_a_call_opened_by_the_prompt_restores_from_a_checkpoint():
    first, events = forced_events([FORCED[:20]])
    saved = json.loads(json.dumps(first.compact_state()))
    second = OutputAssembler.restore("resp_test", saved, events)
    second.feed(FORCED[20:])
    second.finish()
    [call] = second.items
    assert json.loads(call["arguments"]) == CALL["arguments"]


def test_the_assembler_starts_inside_a_call_only_when_one_is_forced():
    named = {"type": "function", "name": "get_weather"}
    for choice, opened in (("required", True), (named, True), ("auto", False), ("none", False)):
        params = GenerationParams(tools=[WEATHER_TOOL], tool_choice=choice)
        assert opens_call(params, SMOLLM2) is opened, choice
        state = OutputAssembler.for_generation("resp_test", params, QWEN3).state()
        assert state["mode"] == ("tool" if opened else "text"), choice
        assert state["tools"] is (choice != "none") and state["reasoning"] is True
    other = ModelSpec("other", "folder", 4096, 1024, ("tools",), tool_format="other")
    assert not opens_call(GenerationParams(tools=[WEATHER_TOOL], tool_choice="required"), other)
    assert not opens_call(GenerationParams(tool_choice="auto"), SMOLLM2)


TAG_IN_ARGUMENT = {"name": "get_weather", "arguments": {"city": 'Hang</tool_call>"zhou\\'}}


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_closing_tag_inside_an_argument_does_not_end_the_call(size):
    """Sampled text may write the tag into a string: the call goes on, and no
    markup becomes message text (seen once in CI at temperature 0.7)."""
    body = json.dumps(TAG_IN_ARGUMENT, separators=(",", ":"))
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    forced, events = forced_events(chunks)
    events += forced.finish()
    tagged_text = f"<tool_call>\n{body}\n</tool_call>"
    tagged, _ = assemble(
        [tagged_text[i : i + size] for i in range(0, len(tagged_text), size)], parse_tools=True
    )
    for assembler in (forced, tagged):
        [call] = assembler.items
        assert call["type"] == "function_call"
        assert json.loads(call["arguments"]) == TAG_IN_ARGUMENT["arguments"]
