"""Grammars and prompts with the real SmolLM2 tokenizer and model, in process."""

from __future__ import annotations

import json
from random import Random

import jsonschema
import pytest
import xgrammar as xgr

from engine.interface import SamplingParams
from generation import prompts, schemas
from generation.params import GenerationParams
from generation.tokens import PIECE_CHARS, prompt_tokenizer
from workers import constraints

from . import reference

pytestmark = pytest.mark.model  # the real model, loaded in this process

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
}
# Bounded, so that a sampled answer always ends within the tests' token
# limits (an unbounded name once ran "Alek@Alek@..." past 40 tokens).
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
}


def json_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def message(role: str, text: str) -> dict:
    return {"type": "message", "role": role, "content": [{"type": "input_text", "text": text}]}


def call_json(name: str, arguments: dict) -> str:
    """A forced call as the model writes it: the prompt opened the tag."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"))


def call_text(name: str, arguments: dict) -> str:
    """A call in Hermes tags, as the model writes it where it chooses to call."""
    return f"<tool_call>\n{call_json(name, arguments)}\n</tool_call>"


def accepts(lm, params: GenerationParams, text: str) -> bool:
    """Whether ``text`` is a whole answer the request's grammar allows."""
    matcher = xgr.GrammarMatcher(constraints.compiled_grammar(lm, params))
    return matcher.accept_string(text) and matcher.is_completed()


def tokens(lm, text: str) -> list[int]:
    return lm.tokenizer(text, add_special_tokens=False)["input_ids"]


def generate(
    lm, params: GenerationParams, prompt: list[int], generated: list[int], limit: int
) -> list[int]:
    """Continue ``generated`` (already produced) by up to ``limit`` tokens, as the runner does."""
    out = list(generated)

    def on_token(token_id: int) -> bool:
        if token_id in lm.eos_token_ids:
            return True
        out.append(token_id)
        return False

    reference.generate(
        lm,
        prompt + out,
        SamplingParams(max_tokens=limit, temperature=0.7),
        on_token,
        constraints.logits_processors(lm, params, out),
    )
    return out


def render(lm, items: list[dict], params: GenerationParams) -> str:
    return prompts.render_prompt(lm.spec, prompt_tokenizer(lm.spec), items, params)


def prompt_ids(lm, params: GenerationParams, text: str) -> list[int]:
    return tokens(lm, render(lm, [message("user", text)], params))


# --- which requests get a grammar ----------------------------------------------------


def test_plain_text_has_no_grammar(lm):
    params = GenerationParams(response_format={"type": "text"}, tools=[], tool_choice="auto")
    assert schemas.grammar_format(params, lm.spec) is None
    assert constraints.logits_processors(lm, params, []) == []
    assert constraints.ended(lm, params, tokens(lm, "Hello there.")) is False


def test_json_schema_grammar_accepts_valid_and_rejects_invalid(lm):
    params = GenerationParams(response_format=json_format(PERSON))
    assert accepts(lm, params, '{"name": "Ada", "age": 36}')
    assert not accepts(lm, params, '{"name": "Ada"}')  # required field missing
    assert not accepts(lm, params, '{"name": "Ada", "age": "36"}')  # wrong type
    assert not accepts(lm, params, '{"name": "Ada", "age": -1}')  # below the minimum
    assert not accepts(lm, params, 'Sure! {"name": "Ada", "age": 36}')  # text around it


def test_required_allows_only_a_call_of_a_listed_tool(lm):
    params = GenerationParams(tools=[WEATHER, TIME], tool_choice="required")
    assert accepts(lm, params, call_json("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert accepts(lm, params, call_json("get_time", {"zone": "UTC"}))
    assert not accepts(lm, params, call_json("get_weather", {"city": "Oslo", "unit": "kelvin"}))
    assert not accepts(lm, params, call_json("get_weather", {"city": "Oslo"}))
    assert not accepts(lm, params, call_json("launch_rocket", {}))
    assert not accepts(lm, params, "It is sunny.")
    # the prompt opened the call: no tags, no whitespace, nothing after the JSON
    assert not accepts(lm, params, call_text("get_time", {"zone": "UTC"}))
    assert not accepts(lm, params, '{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert not accepts(lm, params, call_json("get_time", {"zone": "UTC"}) + "\n</tool_call>")


def test_named_tool_choice_allows_only_that_tool(lm):
    params = GenerationParams(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"}
    )
    assert accepts(lm, params, call_json("get_time", {"zone": "UTC"}))
    assert not accepts(lm, params, call_json("get_weather", {"city": "Oslo", "unit": "celsius"}))


def test_auto_allows_text_and_constrains_a_call_once_started(lm):
    params = GenerationParams(tools=[WEATHER], tool_choice="auto")
    assert accepts(lm, params, "It is probably sunny.")
    call = call_text("get_weather", {"city": "Oslo", "unit": "celsius"})
    assert accepts(lm, params, f"Let me look that up.\n{call}")
    assert not accepts(lm, params, '<tool_call>\n{"name":"get_weather","arguments":{}}')
    assert not accepts(lm, params, "<tool_call>\nI changed my mind.")


def test_none_never_opens_a_call(lm):
    params = GenerationParams(tools=[WEATHER], tool_choice="none")
    assert accepts(lm, params, "It is probably sunny.")
    assert not accepts(lm, params, call_text("get_weather", {"city": "Oslo", "unit": "celsius"}))


def test_compiled_grammars_are_cached_per_schema(lm):
    params = GenerationParams(response_format=json_format(PERSON))
    same = GenerationParams(response_format=json_format(json.loads(json.dumps(PERSON))))
    assert constraints.compiled_grammar(lm, params) is constraints.compiled_grammar(lm, same)
    other = GenerationParams(
        response_format=json_format({"type": "array", "items": {"type": "integer"}})
    )
    assert constraints.compiled_grammar(lm, other) is not constraints.compiled_grammar(lm, params)


# --- the end of a grammar ----------------------------------------------------------


def test_ended_once_the_json_is_complete(lm):
    params = GenerationParams(response_format=json_format(PERSON))
    assert constraints.ended(lm, params, tokens(lm, '{"name": "Ada", "age": 36}'))
    assert not constraints.ended(lm, params, tokens(lm, '{"name": "Ada", "age": 3'))


def test_ended_after_a_required_call_but_not_in_auto_text(lm):
    forced = tokens(lm, call_json("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert constraints.ended(lm, GenerationParams(tools=[WEATHER], tool_choice="required"), forced)
    # in auto mode the model may go on writing after a call
    call = tokens(lm, call_text("get_weather", {"city": "Oslo", "unit": "celsius"}))
    assert not constraints.ended(lm, GenerationParams(tools=[WEATHER], tool_choice="auto"), call)


# --- generation and resuming --------------------------------------------------------


def test_generated_json_validates(lm):
    params = GenerationParams(response_format=json_format(PERSON), tools=[], tool_choice="auto")
    ids = prompt_ids(lm, params, "Invent a person.")
    out = generate(lm, params, ids, [], limit=80)
    answer = json.loads(lm.tokenizer.decode(out))
    jsonschema.validate(answer, PERSON)
    assert constraints.ended(lm, params, out)


def test_resumed_generation_advances_the_grammar_through_earlier_tokens(lm):
    params = GenerationParams(tools=[WEATHER], tool_choice="required")
    ids = prompt_ids(lm, params, "What is the weather in Oslo?")
    first = generate(lm, params, ids, [], limit=12)  # an attempt cut short
    assert len(first) == 12 and not constraints.ended(lm, params, first)
    out = generate(lm, params, ids, first, limit=60)
    assert out[:12] == first
    call = json.loads(lm.tokenizer.decode(out))  # the prompt opened the call: JSON alone
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["parameters"])


def test_tokens_that_break_the_grammar_are_refused_on_resume(lm):
    params = GenerationParams(response_format=json_format(PERSON))
    with pytest.raises(ValueError, match="breaks the grammar"):
        constraints.logits_processors(lm, params, tokens(lm, "Hello"))


# --- schemas xgrammar cannot compile -------------------------------------------------


def test_schema_problem_names_the_schema_and_the_reason():
    bad_pattern = {"type": "string", "pattern": "(["}
    problem = schemas.schema_problem(GenerationParams(response_format=json_format(bad_pattern)))
    assert problem is not None
    param, detail = problem
    assert param == "response_format.json_schema.schema"
    assert "Regex" in detail and "/project/" not in detail
    bad_tool = {**TIME, "name": "broken", "parameters": {"type": "frob"}}
    param, detail = schemas.schema_problem(GenerationParams(tools=[WEATHER, bad_tool]))
    assert param == "tools[1].parameters" and "frob" in detail
    assert schemas.schema_problem(GenerationParams(tools=[WEATHER, TIME])) is None


# --- prompts ------------------------------------------------------------------------


def test_tools_preamble_is_merged_into_the_system_message(lm):
    items = [
        message("system", "Be brief."),
        message("user", "Hi"),
    ]
    params = GenerationParams(tools=[WEATHER, TIME], tool_choice="auto")
    # SmolLM2's template knows no tools
    assert not prompts.has_native_tools(prompt_tokenizer(lm.spec))
    prompt = render(lm, items, params)
    assert prompt.count("<|im_start|>system") == 1
    system = prompt.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert '"name": "get_weather"' in system and '"name": "get_time"' in system
    assert "<tool_call>" in system


def test_tool_choice_decides_which_tools_the_model_is_shown(lm):
    user = [message("user", "Hi")]
    named = GenerationParams(
        tools=[WEATHER, TIME], tool_choice={"type": "function", "name": "get_time"}
    )
    prompt = render(lm, user, named)
    assert '"get_time"' in prompt and '"get_weather"' not in prompt
    none = GenerationParams(tools=[WEATHER], tool_choice="none")
    assert "<tools>" not in render(lm, user, none)


def test_a_forced_call_is_opened_by_the_prompt(lm):
    """With ``required`` or a named tool the tags say nothing: the prompt ends
    inside the call, so the model's output tokens go to the JSON alone."""
    user = [message("user", "What is the weather in Oslo?")]
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        prompt = render(lm, user, GenerationParams(tools=[WEATHER, TIME], tool_choice=choice))
        assert prompt.endswith("<|im_start|>assistant\n<tool_call>\n"), choice
    for choice in ("auto", "none"):
        prompt = render(lm, user, GenerationParams(tools=[WEATHER], tool_choice=choice))
        assert prompt.endswith("<|im_start|>assistant\n"), choice
    # a forced call's prompt describes calls in the tags it opens
    assert "<tool_call>\n{" in render(
        lm, user, GenerationParams(tools=[WEATHER], tool_choice="required")
    )


def test_json_schema_instruction_is_in_the_system_prompt(lm):
    user = [message("user", "Hi")]
    prompt = prompts.render_prompt(
        lm.spec,
        prompt_tokenizer(lm.spec),
        user,
        GenerationParams(response_format=json_format(PERSON)),
    )
    assert prompt.startswith("<|im_start|>system\nAnswer with a JSON value only")
    assert json.dumps(PERSON) in prompt


def test_calls_and_results_are_rendered_back_as_hermes_turns():
    items = [
        message("user", "Weather?"),
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city":"Oslo","unit":"celsius"}',
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp":3}'},
        {"type": "function_call_output", "call_id": "call_2", "output": "12:00"},
    ]
    user, assistant, tool = prompts.chat_messages(items)
    assert user == {"role": "user", "content": "Weather?"}
    assert assistant["role"] == "assistant"
    assert assistant["content"] == (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert tool == {
        "role": "tool",
        "content": '<tool_response>\n{"temp":3}\n</tool_response>\n'
        "<tool_response>\n12:00\n</tool_response>",
    }
    native = prompts.chat_messages(items, native_tools=True)
    assert native[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Oslo", "unit": "celsius"},
    }
    assert [m["role"] for m in native] == ["user", "assistant", "tool", "tool"]


def test_the_web_prompt_tokenizer_renders_and_counts_like_transformers(lm):
    """The web process renders and counts without transformers' tokenizer; the
    worker tokenizes with it: both must see the same text and the same ids."""
    messages = prompts.chat_messages(
        [
            message("system", "You are terse."),
            message("user", "Héllo 👋, what is the weather in Oslo?"),
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": '{"temp": 3}'},
        ]
    )
    web = prompt_tokenizer(lm.spec)
    ours = web.render(messages)
    theirs = lm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert web.count(ours) == len(tokens(lm, ours))


def test_a_long_prompt_is_counted_in_pieces_that_add_up_to_the_whole(lm):
    """Past ``PIECE_CHARS`` a prompt is counted piece by piece (the tokenizer
    lets the GIL go and counting stops at the limit); cut before a space that
    follows a non-space, the pieces count exactly what the whole text does."""
    web = prompt_tokenizer(lm.spec)
    random = Random(29)
    words = [
        "lighthouse",
        "keeper",
        "  double",
        "\n\nparagraph",
        "naïve",
        "👋🏽",
        "東京タワー",
        "x=1;",
        "'s",
        "don't",
        "\t tab",
        "1234567",
        "--",
        "###",
        "   ",
        "é\u0301",
    ]
    text = "".join(
        random.choice(words) + random.choice([" ", "", "\n", "  "]) for _ in range(40_000)
    )
    assert len(text) > 4 * PIECE_CHARS
    whole = web.count(text)
    assert whole == len(tokens(lm, text))
    assert web.count(text, limit=10**9) == whole
    # Past the limit the count stops early, at a number above it.
    assert web.count(text, limit=1000) > 1000
    # A text with no space for pieces on end is cut anywhere: still refused,
    # and counted exactly when it fits.
    assert web.count("[{" * 300_000, limit=8191) > 8191
    one_word = "[{" * (PIECE_CHARS // 2 + 100)
    assert web.count(one_word, limit=10**9) == web.count(one_word)
