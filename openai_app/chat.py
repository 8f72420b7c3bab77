"""Chat Completions (``POST /v1/chat/completions``) as shapes over LMSP.

``lmsp_request`` turns an OpenAI chat body into an LMSP responses request
(validated afterwards by ``responses_app``); ``completion`` turns a finished
LMSP response object into a ``chat.completion``; ``ChunkTranslator`` turns
LMSP stream events, one at a time, into ``chat.completion.chunk`` objects.
All pure: no database, no I/O.

Messages become input items: ``system`` and ``developer`` a system message,
an assistant's ``tool_calls`` ``function_call`` items (the tool call ``id``
is LMSP's ``call_id``), a ``tool`` message a ``function_call_output``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lmsp_core import protocol

from .errors import ParamMap, error_object
from .shapes import check_fields, invalid, require_list, require_object, sent, unsupported_content

SUPPORTED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "tools",
    "tool_choice",
    "response_format",
    "user",  # an end-user id for the caller's own records: changes nothing
}
# Accepted only with the value that asks for nothing this service lacks.
NEUTRAL = {
    "n": (1,),
    "logprobs": (False,),
    "top_p": (1, 1.0),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "parallel_tool_calls": (True,),
    "store": (False,),
    "modalities": (["text"],),
}
UNSUPPORTED_PARTS = ("image_url", "input_audio", "file")


@dataclass(frozen=True)
class ChatRequest:
    request: dict[str, Any]  # the LMSP request, not validated yet
    stream: bool
    include_usage: bool
    param_of: ParamMap  # an LMSP field name -> the chat request's


def _text_of(content: object, param: str, role: str) -> list[Any]:
    """The texts of a message's content (a string or an array of parts)."""
    if isinstance(content, str):
        return [content]
    parts = require_list(content, param)
    texts: list[Any] = []  # checked as LMSP's request
    for index, part in enumerate(parts):
        at = f"{param}[{index}]"
        part = require_object(part, at)
        kind = part.get("type")
        if kind in UNSUPPORTED_PARTS:
            raise unsupported_content(f"{at}.type", kind)
        if kind != "text":
            raise invalid(f"{at}.type", f"Unknown content part type {kind!r} for a {role} message.")
        check_fields(part, {"type", "text"}, {}, f"{at}.")
        texts.append(part.get("text"))
    return texts


def _message_items(message: object, param: str) -> list[dict[str, Any]]:
    message = require_object(message, param)
    role = message.get("role")
    body = sent(message)
    if role in ("system", "developer", "user"):
        check_fields(body, {"role", "content"}, {}, f"{param}.")
        kind, lmsp_role = "input_text", "user" if role == "user" else "system"
        texts = _text_of(message.get("content"), f"{param}.content", role)
        parts = [{"type": kind, "text": text} for text in texts]
        return [{"type": "message", "role": lmsp_role, "content": parts}]
    if role == "assistant":
        check_fields(body, {"role", "content", "tool_calls"}, {"refusal": ()}, f"{param}.")
        items: list[dict[str, Any]] = []
        texts = (
            []
            if body.get("content") is None
            else _text_of(body["content"], f"{param}.content", role)
        )
        calls = require_list(body.get("tool_calls", []), f"{param}.tool_calls")
        if any(texts) or not calls:
            parts = [{"type": "output_text", "text": text} for text in texts]
            items.append({"type": "message", "role": "assistant", "content": parts})
        for index, call in enumerate(calls):
            at = f"{param}.tool_calls[{index}]"
            call = require_object(call, at)
            check_fields(sent(call), {"id", "type", "function"}, {}, f"{at}.")
            if call.get("type") != "function":
                raise invalid(f"{at}.type", "Only 'function' tool calls are supported.")
            function = require_object(call.get("function"), f"{at}.function")
            check_fields(sent(function), {"name", "arguments"}, {}, f"{at}.function.")
            items.append(
                {
                    "type": "function_call",
                    "call_id": call.get("id"),
                    "name": function.get("name"),
                    "arguments": function.get("arguments"),
                }
            )
        return items
    if role == "tool":
        check_fields(body, {"role", "content", "tool_call_id"}, {}, f"{param}.")
        texts = _text_of(message.get("content"), f"{param}.content", role)
        output = "".join(text if isinstance(text, str) else "" for text in texts)
        return [
            {
                "type": "function_call_output",
                "call_id": message.get("tool_call_id"),
                "output": output,
            }
        ]
    if role == "function":
        raise invalid(f"{param}.role", "Function messages are deprecated; use 'tool' messages.")
    raise invalid(f"{param}.role", "Expected 'system', 'developer', 'user', 'assistant' or 'tool'.")


def _tool(tool: object, param: str) -> dict[str, Any]:
    tool = require_object(tool, param)
    check_fields(sent(tool), {"type", "function"}, {}, f"{param}.")
    if tool.get("type") != "function":
        raise invalid(f"{param}.type", "Only 'function' tools are supported.")
    function = require_object(tool.get("function"), f"{param}.function")
    return {"type": "function", **function}


def _tool_choice(choice: object) -> object:
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = require_object(choice.get("function"), "tool_choice.function")
        check_fields(sent(choice), {"type", "function"}, {}, "tool_choice.")
        return {"type": "function", "name": function.get("name")}
    if isinstance(choice, dict):
        raise invalid("tool_choice.type", "Only 'function' tool choices are supported.")
    return choice


def _response_format(value: object) -> object:
    if isinstance(value, dict) and value.get("type") == "json_object":
        raise invalid(
            "response_format.type",
            "'json_object' is not supported; use 'json_schema' with a schema.",
        )
    return value


INPUT_PARAM = re.compile(r"^input\[(\d+)\]")


def lmsp_request(body: object) -> ChatRequest:
    """The LMSP request for a chat completions body (checked for what LMSP
    cannot express; LMSP's validation checks the rest)."""
    body = require_object(body, "body")
    given = sent(body)
    check_fields(given, SUPPORTED, NEUTRAL)
    messages = require_list(body.get("messages"), "messages")
    items, origin = [], []
    for index, message in enumerate(messages):
        made = _message_items(message, f"messages[{index}]")
        items += made
        origin += [index] * len(made)
    request: dict[str, Any] = {"model": body.get("model"), "input": items, "store": False}
    limit_name = None
    for name in ("max_completion_tokens", "max_tokens"):
        if name in given:
            if limit_name is not None:
                raise invalid(name, f"Send either {limit_name} or {name}, not both.")
            limit_name = name
            request["max_output_tokens"] = given[name]
    if "temperature" in given:
        request["temperature"] = given["temperature"]
    if "tools" in given:
        tools = require_list(given["tools"], "tools")
        request["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if "tool_choice" in given:
        request["tool_choice"] = _tool_choice(given["tool_choice"])
    if "response_format" in given:
        request["response_format"] = _response_format(given["response_format"])
    stream = given.get("stream", False)
    if not isinstance(stream, bool):
        raise invalid("stream", "Expected a boolean.")
    include_usage = False
    if "stream_options" in given:
        if not stream:
            raise invalid("stream_options", "Only allowed with stream: true.")
        options = require_object(given["stream_options"], "stream_options")
        check_fields(sent(options), {"include_usage"}, {}, "stream_options.")
        include_usage = options.get("include_usage") is True

    def param_of(name: str) -> str:
        match = INPUT_PARAM.match(name)
        if match:
            return f"messages[{origin[int(match.group(1))]}]" if origin else "messages"
        if name == "input":
            return "messages"
        if name == "max_output_tokens":
            return limit_name or "max_completion_tokens"
        if name.startswith("tools["):  # tools[0].parameters -> tools[0].function.parameters
            head, _, rest = name.partition("].")
            return f"{head}].function.{rest}" if rest and rest != "type" else name
        if name.startswith("tool_choice.name"):
            return "tool_choice.function.name"
        return name

    return ChatRequest(request, stream, include_usage, param_of)


# --- answers ----------------------------------------------------------------------


def usage(lmsp_usage: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompt_tokens": lmsp_usage["input_tokens"],
        "completion_tokens": lmsp_usage["output_tokens"],
        "total_tokens": lmsp_usage["total_tokens"],
        "prompt_tokens_details": {"cached_tokens": protocol.cached_tokens(lmsp_usage)},
    }


def tool_call(item: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }


def finish_reason(
    status: str, incomplete_details: dict[str, Any] | None, called_tools: bool
) -> str:
    if status == "incomplete" and (incomplete_details or {}).get("reason") == "max_output_tokens":
        return "length"
    return "tool_calls" if called_tools else "stop"


def completion(result: dict[str, Any]) -> dict[str, Any]:
    """The ``chat.completion`` of a finished LMSP response object."""
    texts, calls, thoughts = [], [], []
    for item in result["output"]:
        if item["type"] == "message":
            texts += [part["text"] for part in item["content"]]
        elif item["type"] == "function_call":
            calls.append(tool_call(item))
        elif item["type"] == "reasoning":
            thoughts += [part["text"] for part in item["summary"]]
    message: dict[str, Any] = {
        "role": "assistant",
        "content": "".join(texts) if texts or not calls else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    return {
        "id": result["id"],
        "object": "chat.completion",
        "created": result["created_at"],
        "model": result["model"],
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": finish_reason(
                    result["status"], result["incomplete_details"], bool(calls)
                ),
            }
        ],
        "usage": usage(result["usage"]),
        "system_fingerprint": None,
    }


@dataclass
class ChunkTranslator:
    """LMSP stream events in, ``chat.completion.chunk`` objects out (an
    ``{"error": ...}`` object for a failed response, as OpenAI streams do)."""

    completion_id: str
    created: int
    model: str
    include_usage: bool = False
    tool_index: dict[str, int] = field(default_factory=dict)  # LMSP item id -> tool call index

    def _chunk(self, delta: dict[str, Any] | None, finish: str | None = None) -> dict[str, Any]:
        chunk: dict[str, Any] = {
            "id": self.completion_id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": []
            if delta is None
            else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return chunk

    def translate(self, event: str, data: dict[str, Any]) -> list[dict[str, Any]]:
        if event == "response.created":
            return [self._chunk({"role": "assistant", "content": ""})]
        if event == "response.output_text.delta":
            return [self._chunk({"content": data["delta"]})]
        if event == "response.reasoning_summary_text.delta":
            return [self._chunk({"reasoning_content": data["delta"]})]
        if event == "response.output_item.added" and data["item"]["type"] == "function_call":
            item = data["item"]
            index = self.tool_index[item["id"]] = len(self.tool_index)
            call = {"index": index, **tool_call(item)}
            return [self._chunk({"tool_calls": [call]})]
        if event == "response.function_call_arguments.delta":
            index = self.tool_index[data["item_id"]]
            return [
                self._chunk(
                    {"tool_calls": [{"index": index, "function": {"arguments": data["delta"]}}]}
                )
            ]
        if event in ("response.completed", "response.incomplete", "response.cancelled"):
            reason = finish_reason(
                data["status"], data.get("incomplete_details"), bool(self.tool_index)
            )
            chunks = [self._chunk({}, reason)]
            if self.include_usage:
                chunks.append({**self._chunk(None), "usage": usage(data["usage"])})
            return chunks
        if event in ("response.failed", "error"):  # error: the stream was cut short
            return [{"error": error_object(data["error"])}]
        return []
