"""OpenAI's Responses API (``/v1/responses``) as shapes over LMSP.

LMSP is Responses-style already, so most of a request passes through:
``lmsp_request`` turns a string ``input`` into a user message, ``instructions``
into a leading system message, ``developer`` into ``system`` and
``text.format`` into ``response_format``; ``response_object`` adds the
members OpenAI's response object has beyond LMSP's; ``EventTranslator``
turns LMSP stream events into OpenAI's, numbered by ``sequence_number``.
All pure: no database, no I/O.

Ids: the OpenAI response id *is* the LMSP response id (``resp_...``), for
background responses too; the task behind a background response is found
from it. Sequence numbers count OpenAI events from 0 and follow from the
task's event log deterministically (each LMSP event always becomes the same
OpenAI events), so resuming with ``starting_after`` replays the log through
the translator and drops what the client has seen.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from lmsp_core import protocol

from .errors import ParamMap, error_object
from .shapes import check_fields, invalid, require_list, require_object, sent

SUPPORTED = {
    "model",
    "input",
    "instructions",
    "stream",
    "background",
    "max_output_tokens",
    "temperature",
    "tools",
    "tool_choice",
    "text",
    "store",
    "previous_response_id",
    "user",  # an end-user id for the caller's own records: changes nothing
}
NEUTRAL: dict[str, tuple[object, ...]] = {
    "top_p": (1, 1.0),
    "parallel_tool_calls": (True,),
    "truncation": ("disabled",),
    "include": ([],),
}


@dataclass(frozen=True)
class ResponsesRequest:
    request: dict[str, Any]  # the LMSP request, not validated yet
    stream: bool
    background: bool
    param_of: ParamMap  # an LMSP field name -> the OpenAI request's


def _input_item(item: object, param: str) -> object:
    if not isinstance(item, dict):
        return item  # LMSP's validation names the wrong type
    item = dict(item)
    if "type" not in item and "role" in item:
        item["type"] = "message"  # OpenAI's "easy" input message
    if item.get("type") == "message":
        if item.get("role") == "developer":
            item["role"] = "system"
        if isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        elif isinstance(item.get("content"), list):
            item["content"] = [_part(part) for part in item["content"]]
    if item.get("type") == "reasoning" and item.get("encrypted_content") is None:
        item.pop("encrypted_content", None)
    return item


def _part(part: object) -> object:
    """Output text sent back as received: empty ``logprobs`` ask for nothing."""
    if isinstance(part, dict) and part.get("type") == "output_text" and not part.get("logprobs"):
        return {name: value for name, value in part.items() if name != "logprobs"}
    return part


def _response_format(text: object) -> dict[str, Any] | None:
    text = require_object(text, "text")
    check_fields(sent(text), {"format"}, {"verbosity": ("medium",)}, "text.")
    if text.get("format") is None:
        return None
    fmt = require_object(text["format"], "text.format")
    if fmt.get("type") == "json_schema":
        schema = {name: value for name, value in fmt.items() if name != "type"}
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        raise invalid(
            "text.format.type", "'json_object' is not supported; use 'json_schema' with a schema."
        )
    return fmt


ITEM_PARAM = re.compile(r"^input\[(\d+)\]")


def lmsp_request(body: object) -> ResponsesRequest:
    body = require_object(body, "body")
    given = sent(body)
    check_fields(given, SUPPORTED, NEUTRAL)
    raw_input = body.get("input")
    raw_items: list[Any]
    if isinstance(raw_input, str):
        raw_items = [{"type": "message", "role": "user", "content": raw_input}]
    else:
        raw_items = require_list(raw_input, "input")
    items: list[object] = [_input_item(item, f"input[{i}]") for i, item in enumerate(raw_items)]
    instructions = given.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "Expected a string.")
        system: dict[str, str] = {"type": "input_text", "text": instructions}
        items = [{"type": "message", "role": "system", "content": [system]}, *items]
    request: dict[str, Any] = {
        "model": body.get("model"),
        "input": items,
        "store": given.get("store", True),  # OpenAI keeps responses unless told not to
    }
    for name in ("max_output_tokens", "temperature", "tools", "tool_choice"):
        if name in given:
            request[name] = given[name]
    if "previous_response_id" in given:
        request["previous_response_id"] = given["previous_response_id"]
    if "text" in given:
        fmt = _response_format(given["text"])
        if fmt is not None:
            request["response_format"] = fmt
    stream, background = given.get("stream", False), given.get("background", False)
    for name, value in (("stream", stream), ("background", background)):
        if not isinstance(value, bool):
            raise invalid(name, "Expected a boolean.")
    shift = 1 if instructions is not None else 0

    def param_of(name: str) -> str:
        name = name.removeprefix("request.")  # a background request is a task's
        match = ITEM_PARAM.match(name)
        if match:
            index = int(match.group(1)) - shift
            if index < 0:
                return "instructions"
            return f"input[{index}]" + name[match.end() :]
        if name == "response_format" or name.startswith("response_format.json_schema."):
            rest = name.removeprefix("response_format").removeprefix(".json_schema")
            return "text.format" + rest
        return name

    return ResponsesRequest(request, stream, background, param_of)


# --- answers ----------------------------------------------------------------------


def usage(lmsp_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if lmsp_usage is None:
        return None
    return {
        "input_tokens": lmsp_usage["input_tokens"],
        "input_tokens_details": {"cached_tokens": protocol.cached_tokens(lmsp_usage)},
        "output_tokens": lmsp_usage["output_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": lmsp_usage["total_tokens"],
    }


def output_item(item: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    """An LMSP output item as OpenAI's (the same, plus statuses and annotations)."""
    if item["type"] == "message":
        parts = [
            {"type": "output_text", "text": part["text"], "annotations": []}
            for part in item["content"]
        ]
        return {**item, "status": status, "content": parts}
    if item["type"] == "function_call":
        return {**item, "status": status}
    return item


def _text_format(response_format: dict[str, Any] | None) -> dict[str, Any]:
    if not response_format or response_format.get("type") != "json_schema":
        return {"format": {"type": "text"}}
    return {"format": {"type": "json_schema", **response_format["json_schema"]}}


def response_object(
    result: dict[str, Any], params: dict[str, Any], *, background: bool, status: str | None = None
) -> dict[str, Any]:
    """OpenAI's response object for an LMSP response object and the
    generation parameters it was made with (``GenerationParams.as_json``);
    ``status`` overrides LMSP's (a queued background response)."""
    error = result.get("error")
    return {
        "id": result["id"],
        "object": "response",
        "created_at": result["created_at"],
        "status": status or result["status"],
        "background": background,
        "model": result["model"],
        "output": [output_item(item) for item in result["output"]],
        "usage": usage(result.get("usage")),
        "error": None
        if error is None
        else {"code": error.get("code"), "message": error.get("detail")},
        "incomplete_details": result.get("incomplete_details"),
        "instructions": None,
        "max_output_tokens": params.get("max_output_tokens") or None,
        "metadata": {},
        "parallel_tool_calls": True,
        "previous_response_id": result.get("previous_response_id"),
        "store": result.get("store", False),
        "temperature": params.get("temperature"),
        "text": _text_format(params.get("response_format")),
        "tool_choice": params.get("tool_choice", "auto"),
        "tools": params.get("tools", []),
        "top_p": 1.0,
        "truncation": "disabled",
    }


FINAL_NAMES = {
    "response.completed": "response.completed",
    "response.incomplete": "response.incomplete",
    "response.failed": "response.failed",
    # OpenAI defines no stream event for a cancelled response: this one is
    # LMSP's, with the response object in OpenAI's shape (status cancelled).
    "response.cancelled": "response.cancelled",
}


@dataclass
class EventTranslator:
    """LMSP stream events in, OpenAI Responses events out, as (type, data)
    pairs whose data carries ``type`` and ``sequence_number``.

    ``base`` is the response object when it was created (status
    ``in_progress``, no output); the final event's response object is built
    from it and the items the stream delivered.
    """

    base: dict[str, Any]
    next_sequence: int = 0
    items: dict[int, dict[str, Any]] = field(default_factory=dict)  # output_index -> done item
    index_of: dict[str, int] = field(default_factory=dict)  # item id -> output_index

    def _event(self, kind: str, **data: object) -> tuple[str, dict[str, Any]]:
        event = {"type": kind, "sequence_number": self.next_sequence, **data}
        self.next_sequence += 1
        return kind, event

    def _response(self, **changes: object) -> dict[str, Any]:
        output = [self.items[index] for index in sorted(self.items)]
        return {**self.base, "output": output, **changes}

    def translate(self, event: str, data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        if event == "response.created":
            started = self._response(status="in_progress")
            return [
                self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
            ]
        if event == "response.output_item.added":
            return self._added(data["output_index"], data["item"])
        if event == "response.output_item.done":
            return self._done(data["output_index"], data["item"])
        if event in ("response.output_text.delta", "response.reasoning_summary_text.delta"):
            where = {"item_id": data["item_id"], "output_index": self.index_of[data["item_id"]]}
            if event == "response.output_text.delta":
                return [
                    self._event(event, **where, content_index=0, delta=data["delta"], logprobs=[])
                ]
            return [self._event(event, **where, summary_index=0, delta=data["delta"])]
        if event == "response.function_call_arguments.delta":
            index = self.index_of[data["item_id"]]
            return [
                self._event(event, item_id=data["item_id"], output_index=index, delta=data["delta"])
            ]
        if event in FINAL_NAMES:
            error = data.get("error")
            final = self._response(
                status=data["status"],
                usage=usage(data.get("usage")) if data.get("usage") else self.base.get("usage"),
                incomplete_details=data.get("incomplete_details"),
                error=None
                if error is None
                else {"code": error["code"], "message": error["detail"]},
            )
            return [self._event(FINAL_NAMES[event], response=final)]
        if event == "error":
            body = error_object(data["error"])
            return [
                self._event(
                    "error", code=body["code"], message=body["message"], param=body["param"]
                )
            ]
        return []  # an event OpenAI has no counterpart for

    def _added(self, index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        self.index_of[item["id"]] = index
        announced = output_item(item, status="in_progress")
        events = [self._event("response.output_item.added", output_index=index, item=announced)]
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = {"type": "output_text", "text": "", "annotations": []}
            events.append(
                self._event("response.content_part.added", **where, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            part = {"type": "summary_text", "text": ""}
            events.append(
                self._event(
                    "response.reasoning_summary_part.added", **where, summary_index=0, part=part
                )
            )
        return events

    def _done(self, index: int, item: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        done = self.items[index] = output_item(item)
        where = {"item_id": item["id"], "output_index": index}
        events = []
        if item["type"] == "message":
            for content_index, part in enumerate(done["content"]):
                events.append(
                    self._event(
                        "response.output_text.done",
                        **where,
                        content_index=content_index,
                        text=part["text"],
                        logprobs=[],
                    )
                )
                events.append(
                    self._event(
                        "response.content_part.done",
                        **where,
                        content_index=content_index,
                        part=part,
                    )
                )
        elif item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        elif item["type"] == "reasoning":
            for summary_index, part in enumerate(item["summary"]):
                events.append(
                    self._event(
                        "response.reasoning_summary_text.done",
                        **where,
                        summary_index=summary_index,
                        text=part["text"],
                    )
                )
                events.append(
                    self._event(
                        "response.reasoning_summary_part.done",
                        **where,
                        summary_index=summary_index,
                        part=part,
                    )
                )
        events.append(self._event("response.output_item.done", output_index=index, item=done))
        return events
