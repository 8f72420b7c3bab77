"""A stored response as people read it in the admin: the conversation turn by
turn (the ``previous_response_id`` chain first), and its event timeline."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tasks_app.models import Event, Task

from .models import Response
from .selectors import conversation_chain

# A long generation logs one event per few tokens; the page shows the start.
TIMELINE_LIMIT = 2000
DATA_PREVIEW_CHARS = 300


@dataclass(frozen=True)
class Entry:
    kind: str  # message, function_call, function_call_output, reasoning, or the unknown type
    role: str  # system, user, assistant or tool: who "speaks" in the chat
    text: str
    source: str  # "input" (the client sent it) or "output" (the model wrote it)
    name: str = ""
    call_id: str = ""


@dataclass(frozen=True)
class Turn:
    response: Response
    entries: list[Entry] = field(default_factory=list)


@dataclass(frozen=True)
class TimelineEvent:
    seq: int
    type: str
    created_at: object
    preview: str


@dataclass(frozen=True)
class Timeline:
    task: Task | None
    events: list[TimelineEvent]
    truncated: bool


def _pretty(text: str) -> str:
    """Indent JSON (tool arguments and results usually are); anything else as is."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError):  # not JSON, or nested past the parser
        return text


def entry(item: dict[str, Any], source: str) -> Entry:
    kind = item.get("type", "")
    if kind == "message":
        text = "".join(part.get("text", "") for part in item.get("content", []))
        return Entry(kind, item.get("role", ""), text, source)
    if kind == "function_call":
        return Entry(
            kind,
            "assistant",
            _pretty(item.get("arguments", "")),
            source,
            name=item.get("name", ""),
            call_id=item.get("call_id", ""),
        )
    if kind == "function_call_output":
        return Entry(
            kind, "tool", _pretty(item.get("output", "")), source, call_id=item.get("call_id", "")
        )
    if kind == "reasoning":
        text = "".join(part.get("text", "") for part in item.get("summary", []))
        return Entry(kind, "assistant", text, source)
    return Entry(kind, "", json.dumps(item, indent=2, ensure_ascii=False), source)


def conversation(response: Response) -> list[Turn]:
    """Every turn from the first response of the chain to this one, in order."""
    return [
        Turn(
            turn,
            [entry(item, "input") for item in turn.input]
            + [entry(item, "output") for item in turn.output],
        )
        for turn in conversation_chain(response)
    ]


def _preview(event_type: str, data: str) -> str:
    if event_type.endswith(".delta"):
        try:
            return repr(json.loads(data).get("delta", ""))
        except ValueError:
            pass
    if len(data) > DATA_PREVIEW_CHARS:
        return data[:DATA_PREVIEW_CHARS] + "…"
    return data


def timeline(response: Response) -> Timeline:
    task = Task.objects.filter(response=response).first()
    if task is None:
        return Timeline(None, [], False)
    rows = list(
        Event.objects.filter(task=task)
        .order_by("seq")[: TIMELINE_LIMIT + 1]
        .values_list("seq", "type", "created_at", "data")
    )
    events = [TimelineEvent(seq, kind, at, _preview(kind, data)) for seq, kind, at, data in rows]
    return Timeline(task, events[:TIMELINE_LIMIT], len(events) > TIMELINE_LIMIT)
