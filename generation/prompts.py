"""From protocol input items to the text the model reads.

The web process renders the prompt (it needs the token count to refuse a
request that does not fit), stores it on the response, and the worker
tokenizes exactly that text.

Tools reach the model through its chat template when the template knows
tools; otherwise they are described in a system preamble in the Hermes/Qwen
style (``<tools>`` ... ``</tools>``, calls in ``<tool_call>`` tags), the
format the output parser and the grammars in ``schemas`` expect. When a call
is forced, the prompt ends with its opening tag (``output.opens_call``): the
model then writes only the call's JSON.
"""

from __future__ import annotations

import json
from typing import Any

from .output import CALL_OPENING, TOOL_CLOSE, TOOL_OPEN, opens_call
from .params import GenerationParams
from .registry import ModelSpec
from .schemas import NO_PARAMETERS
from .tokens import PromptTokenizer

TOOLS_PREAMBLE = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments \
within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>

The results of the calls come back within <tool_response></tool_response> XML tags. \
Then answer the user in plain sentences, using the results."""

TOOL_CHOICE_HINTS = {
    "auto": "",
    "required": "Answer with a function call.",
}

JSON_INSTRUCTION = """Answer with a JSON value only, no other text. \
It must follow this JSON schema:
{schema}"""


def _text(parts: list[dict[str, Any]]) -> str:
    return "".join(part["text"] for part in parts)


def _arguments(item: dict[str, Any]) -> object:
    """A call's arguments as JSON when they are JSON, else the text sent (a
    model's call may be cut short); nested past the parser's recursion limit
    (``[[[...`` a megabyte deep) they are text as well."""
    try:
        return json.loads(item["arguments"])
    except (ValueError, RecursionError):
        return item["arguments"]


def _tool_call_text(item: dict[str, Any]) -> str:
    call = json.dumps({"name": item["name"], "arguments": _arguments(item)}, ensure_ascii=False)
    return f"{TOOL_OPEN}\n{call}\n{TOOL_CLOSE}"


def chat_messages(items: list[dict[str, Any]], native_tools: bool = False) -> list[dict[str, Any]]:
    """Chat-template messages for input items, in order.

    A ``function_call`` is what the assistant said and a
    ``function_call_output`` is the tool's answer. A template that knows
    tools gets them as ``tool_calls`` and ``tool`` messages, which it
    formats itself; for any other template they are written out the way
    Hermes-style models see them: calls in the assistant's turn, results in
    ``<tool_response>`` tags in a ``tool`` turn (SmolLM2 answers from the
    result there; in a ``user`` turn it only echoes it). Consecutive calls
    (or results) share one turn, as a model that makes parallel calls
    writes them.
    Reasoning items are not shown to the model again.
    """
    messages: list[dict[str, Any]] = []
    # The texts of a Hermes turn that calls or results join, by the turn's
    # index: joined once at the end (added to the turn one by one, a
    # thousand results of a kilobyte copied half a gigabyte).
    joined: dict[int, list[str]] = {}

    def last(role: str) -> dict[str, Any] | None:
        return messages[-1] if messages and messages[-1]["role"] == role else None

    def join(role: str, text: str) -> None:
        if last(role) is None:
            messages.append({"role": role, "content": text})
        else:
            joined.setdefault(len(messages) - 1, [messages[-1]["content"]]).append(text)

    for item in items:
        kind = item["type"]
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call" and native_tools:
            function = {"name": item["name"], "arguments": _arguments(item)}
            call = {"type": "function", "function": function}
            turn = last("assistant")
            if turn is None:
                turn = {"role": "assistant", "content": ""}
                messages.append(turn)
            turn.setdefault("tool_calls", []).append(call)
        elif kind == "function_call":
            join("assistant", _tool_call_text(item))
        elif kind == "function_call_output" and native_tools:
            messages.append({"role": "tool", "content": item["output"]})
        elif kind == "function_call_output":
            join("tool", f"<tool_response>\n{item['output']}\n</tool_response>")
    for index, texts in joined.items():
        turn = messages[index]
        turn["content"] = "\n".join(texts)
        if turn["role"] == "assistant":  # calls after an empty text start the turn
            turn["content"] = turn["content"].lstrip("\n")
    return messages


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    """A protocol tool in the OpenAI chat shape that chat templates and the
    Hermes preamble both use."""
    function = {"name": tool["name"]}
    if tool.get("description"):
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or NO_PARAMETERS
    return {"type": "function", "function": function}


def _offered_tools(params: GenerationParams) -> list[dict[str, Any]]:
    """The tools the model is told about: none with ``tool_choice: none`` (it
    cannot call them), only the named one when one is forced."""
    tools, choice = params.tools, params.tool_choice
    if choice == "none":
        return []
    if isinstance(choice, dict):
        return [tool for tool in tools if tool["name"] == choice["name"]]
    return tools


def system_instructions(params: GenerationParams, native_tools: bool) -> str:
    """What the system prompt adds for tools and structured output."""
    parts = []
    tools = _offered_tools(params)
    if tools and not native_tools:
        listed = "\n".join(json.dumps(_function(t), ensure_ascii=False) for t in tools)
        parts.append(TOOLS_PREAMBLE.format(tools=listed))
    choice = params.tool_choice
    if tools:
        hint = (
            f"Answer with a call of the function {choice['name']}."
            if isinstance(choice, dict)
            else TOOL_CHOICE_HINTS[choice]
        )
        if hint:
            parts.append(hint)
    if params.json_schema is not None:
        schema = json.dumps(params.json_schema, ensure_ascii=False)
        parts.append(JSON_INSTRUCTION.format(schema=schema))
    return "\n\n".join(parts)


def has_native_tools(tokenizer: PromptTokenizer) -> bool:
    return "tools" in tokenizer.chat_template


def render_prompt(
    spec: ModelSpec,
    tokenizer: PromptTokenizer,
    items: list[dict[str, Any]],
    params: GenerationParams,
) -> str:
    """The text the model reads for ``items``, up to where its answer starts:
    after the assistant's generation prompt, or inside the call a request
    forces (``CALL_OPENING``), whose tag is then input, not output."""
    native_tools = has_native_tools(tokenizer)
    messages = chat_messages(items, native_tools)
    extra = system_instructions(params, native_tools)
    if extra:
        if messages and messages[0]["role"] == "system":
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{extra}"}
        else:
            messages.insert(0, {"role": "system", "content": extra})
    tools = _offered_tools(params)
    native = [_function(tool) for tool in tools] if native_tools and tools else None
    prompt = tokenizer.render(messages, native)
    return prompt + CALL_OPENING if opens_call(params, spec) else prompt
