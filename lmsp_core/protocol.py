"""The protocol's JSON shapes: every object and event body the API sends is
built here, so that a field is named and ordered the same way everywhere.

Pure functions of plain values: they read the attributes of whatever record
they are given (a model spec, a response, a task) and import no app, so
every layer can build the same shapes.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, overload

FINAL_EVENTS = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled"}
)


def dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


@overload
def timestamp(moment: datetime) -> int: ...
@overload
def timestamp(moment: None) -> None: ...
def timestamp(moment: datetime | None) -> int | None:
    return int(moment.timestamp()) if moment is not None else None


# --- objects -----------------------------------------------------------------


def model_object(spec: Any) -> dict[str, Any]:  # generation.registry.ModelSpec
    return {
        "id": spec.id,
        "object": "model",
        "context_window": spec.context_window,
        "max_output_tokens": spec.max_output_tokens,
        "capabilities": list(spec.capabilities),
    }


def usage(input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """A usage object; ``cached_tokens``: the input tokens the worker took from
    its prefix cache (its owner's own prefixes, unless the model shares them)."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
    }


def cached_tokens(usage_body: dict[str, Any]) -> int:
    """The cached input tokens a usage object names (0 in usage written before
    they were reported)."""
    return int(usage_body.get("input_tokens_details", {}).get("cached_tokens", 0))


# PostgreSQL's jsonb keeps members sorted its own way; answers list them in
# the order the protocol's examples use, so stored and streamed items read alike.
MEMBER_ORDER = (
    "id type role status call_id name arguments output content summary text annotations"
).split()


def in_protocol_order(value: Any) -> Any:
    if isinstance(value, list):
        return [in_protocol_order(member) for member in value]
    if isinstance(value, dict):
        rank = {name: index for index, name in enumerate(MEMBER_ORDER)}
        ordered = sorted(value, key=lambda name: rank.get(name, len(rank)))
        return {name: in_protocol_order(value[name]) for name in ordered}
    return value


def response_object(response: Any) -> dict[str, Any]:  # responses_app.models.Response
    return {
        "id": response.id,
        "object": "response",
        "created_at": timestamp(response.created_at),
        "status": response.status,
        "model": response.model,
        "output": in_protocol_order(response.output),
        "usage": usage(response.input_tokens, response.output_tokens, response.cached_tokens),
        "error": response.error,
        "incomplete_details": response.incomplete_details,
        "previous_response_id": response.previous_response_id,
        "store": response.store,
    }


def task_object(task: Any, queue_position: int | None = None) -> dict[str, Any]:  # tasks_app Task
    """``queue_position``: 1 for the next task its model's workers take, None
    (null) when the task is not waiting (tasks_app.fairness computes it).
    ``waiting_reason``: why its upstream server could not take it, while it
    waits for that server (tasks_app.upstream_waits), else null."""
    final = task.is_final
    return {
        "id": task.id,
        "object": "task",
        "type": "response",
        "status": task.status,
        "queue_position": queue_position,
        "waiting_reason": task.waiting_reason or None,
        "waiting_since": timestamp(task.waiting_since),
        "created_at": timestamp(task.created_at),
        "started_at": timestamp(task.started_at),
        "completed_at": timestamp(task.completed_at),
        "response_id": task.response_id,
        "result": response_object(task.response) if final else None,
        "error": task.error,
        "last_event_id": task.last_event_id,
        "first_available_event_id": task.first_available_event_id,
    }


def deleted_object(response_id: str) -> dict[str, Any]:
    """The answer to ``DELETE /responses/{id}``."""
    return {"id": response_id, "object": "response.deleted", "deleted": True}


def list_object(
    data: list[dict[str, Any]], *, has_more: bool | None = None, next_cursor: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"object": "list", "data": data}
    if has_more is not None:
        body["has_more"] = has_more
        body["next_cursor"] = next_cursor
    return body


# --- output items ----------------------------------------------------------------


def message_item(item_id: str, text: str | None) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text}]
    return {"id": item_id, "type": "message", "role": "assistant", "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    summary = [] if text is None else [{"type": "summary_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": summary}


# --- stream events: (event name, data) pairs --------------------------------------


def created_event(response_id: str) -> tuple[str, dict[str, Any]]:
    return "response.created", {"response_id": response_id, "status": "in_progress"}


def item_added_event(
    response_id: str, output_index: int, item: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    return "response.output_item.added", {
        "response_id": response_id,
        "output_index": output_index,
        "item": item,
    }


def _delta(event: str, response_id: str, item_id: str, delta: str) -> tuple[str, dict[str, Any]]:
    return event, {"response_id": response_id, "item_id": item_id, "delta": delta}


def text_delta_event(response_id: str, item_id: str, delta: str) -> tuple[str, dict[str, Any]]:
    return _delta("response.output_text.delta", response_id, item_id, delta)


def reasoning_delta_event(response_id: str, item_id: str, delta: str) -> tuple[str, dict[str, Any]]:
    return _delta("response.reasoning_summary_text.delta", response_id, item_id, delta)


def arguments_delta_event(response_id: str, item_id: str, delta: str) -> tuple[str, dict[str, Any]]:
    return _delta("response.function_call_arguments.delta", response_id, item_id, delta)


def item_done_event(
    response_id: str, output_index: int, item: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    return "response.output_item.done", {
        "response_id": response_id,
        "output_index": output_index,
        "item": item,
    }


def completed_event(response_id: str, usage_body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "response.completed", {
        "response_id": response_id,
        "status": "completed",
        "usage": usage_body,
    }


def incomplete_event(
    response_id: str, reason: str, usage_body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    return "response.incomplete", {
        "response_id": response_id,
        "status": "incomplete",
        "incomplete_details": {"reason": reason},
        "usage": usage_body,
    }


def failed_event(response_id: str, error: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "response.failed", {"response_id": response_id, "status": "failed", "error": error}


def cancelled_event(response_id: str, usage_body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "response.cancelled", {
        "response_id": response_id,
        "status": "cancelled",
        "usage": usage_body,
    }


def sse_frame(event_id: int, event: str, data_json: str) -> bytes:
    """One server-sent event. Ids are integers and names come from this module,
    so neither can carry CR, LF or NUL; data is compact JSON on one line."""
    return f"id: {event_id}\nevent: {event}\ndata: {data_json}\n\n".encode()


def error_frame(data_json: str) -> bytes:
    """The ``error`` event that ends a stream which cannot go on: no event of
    the log, so it has no id (a client's last id stays that of the last
    event it got)."""
    return f"event: error\ndata: {data_json}\n\n".encode()


KEEPALIVE_FRAME = b": keep-alive\n\n"


def queued_frame(position: int) -> bytes:
    """The keep-alive comment of a stream whose task is still waiting."""
    return f": queued {int(position)}\n\n".encode()
