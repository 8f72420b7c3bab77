"""Typed stream events of LMSP 1.0 (section 6.3), parsed from SSE fields.

A client gets events as ``event:`` / ``data:`` / ``id:`` fields; here each
event type of the protocol becomes a dataclass with its documented members,
so that callers write ``event.delta`` instead of ``event["data"]["delta"]``.
An event type this module does not know (the spec lets services add some)
still parses, as ``UnknownEvent``, and ``data`` always keeps the whole
original object, members this module does not name included.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

FINAL_TYPES = frozenset(
    {"response.completed", "response.incomplete", "response.failed", "response.cancelled", "error"}
)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One server-sent event. ``id`` is the event's sequence number (``None`` if
    the server sent none); ``data`` is the whole JSON object as received."""

    type: ClassVar[str] = ""
    fields: ClassVar[tuple[str, ...]] = ()

    id: int | None
    data: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def event_type(self) -> str:
        return self.type

    @property
    def is_final(self) -> bool:
        """True for the events after which the service closes the stream."""
        return self.event_type in FINAL_TYPES

    def to_data(self) -> dict[str, Any]:
        """The JSON object this event stands for: the typed members over any
        members only ``data`` carries."""
        body = dict(self.data)
        body.update({name: getattr(self, name) for name in self.fields})
        return body

    def to_sse(self) -> str:
        """The event as SSE text, as the service would write it."""
        lines = [] if self.id is None else [f"id: {self.id}"]
        lines.append(f"event: {self.event_type}")
        data = json.dumps(self.to_data(), ensure_ascii=False, separators=(",", ":"))
        lines.append(f"data: {data}")
        return "\n".join(lines) + "\n\n"


# The members of each event type are its dataclass fields (``fields`` lists
# them, set below from the dataclass); a type with no members of its own over
# its base's only names itself, and needs no @dataclass of its own.


@dataclass(frozen=True, kw_only=True)
class _ResponseEvent(Event):
    response_id: str


@dataclass(frozen=True, kw_only=True)
class _StatusEvent(_ResponseEvent):
    status: str


class ResponseCreated(_StatusEvent):
    type: ClassVar[str] = "response.created"


@dataclass(frozen=True, kw_only=True)
class _ItemEvent(_ResponseEvent):
    output_index: int
    item: dict[str, Any]


class OutputItemAdded(_ItemEvent):
    type: ClassVar[str] = "response.output_item.added"


class OutputItemDone(_ItemEvent):
    type: ClassVar[str] = "response.output_item.done"


@dataclass(frozen=True, kw_only=True)
class _Delta(_ResponseEvent):
    item_id: str
    delta: str


class OutputTextDelta(_Delta):
    """Text appended to a message item."""

    type: ClassVar[str] = "response.output_text.delta"


class ReasoningSummaryTextDelta(_Delta):
    """Text appended to a reasoning item's summary (thinking models)."""

    type: ClassVar[str] = "response.reasoning_summary_text.delta"


class FunctionCallArgumentsDelta(_Delta):
    """Characters appended to a function call's JSON ``arguments``."""

    type: ClassVar[str] = "response.function_call_arguments.delta"


@dataclass(frozen=True, kw_only=True)
class _Ended(_StatusEvent):
    usage: dict[str, Any] | None = None


class ResponseCompleted(_Ended):
    type: ClassVar[str] = "response.completed"


class ResponseCancelled(_Ended):
    type: ClassVar[str] = "response.cancelled"


@dataclass(frozen=True, kw_only=True)
class ResponseIncomplete(_StatusEvent):
    type: ClassVar[str] = "response.incomplete"
    incomplete_details: dict[str, Any] | None = None
    usage: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class ResponseFailed(_StatusEvent):
    type: ClassVar[str] = "response.failed"
    error: dict[str, Any] | None = None


@dataclass(frozen=True, kw_only=True)
class ErrorEvent(Event):
    """A problem not tied to one response; the stream cannot continue."""

    type: ClassVar[str] = "error"
    error: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class UnknownEvent(Event):
    """An event type this client does not know, or one whose data does not
    have the members its type requires: kept as received."""

    name: str

    @property
    def event_type(self) -> str:
        return self.name

    def to_data(self) -> dict[str, Any]:
        return dict(self.data)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        ResponseCreated,
        OutputItemAdded,
        OutputTextDelta,
        ReasoningSummaryTextDelta,
        FunctionCallArgumentsDelta,
        OutputItemDone,
        ResponseCompleted,
        ResponseIncomplete,
        ResponseFailed,
        ResponseCancelled,
        ErrorEvent,
    )
}

for _cls in EVENT_TYPES.values():
    _cls.fields = tuple(f.name for f in dataclasses.fields(_cls) if f.name not in ("id", "data"))

DELTA_TYPES = (OutputTextDelta, ReasoningSummaryTextDelta, FunctionCallArgumentsDelta)


def parse_event(
    name: str, data: str | dict[str, Any] | None, event_id: str | int | None = None
) -> Event:
    """An event from its SSE fields: ``event`` name, ``data`` (JSON text or an
    already parsed object) and ``id`` (text or int; empty means none)."""
    if isinstance(data, str):
        try:
            body: Any = json.loads(data) if data else {}
        except ValueError:
            body = {"_text": data}
    else:
        body = data if data is not None else {}
    if not isinstance(body, dict):
        body = {"_value": body}
    number = _event_id(event_id)
    cls = EVENT_TYPES.get(name)
    if cls is not None:
        members = {key: body[key] for key in cls.fields if key in body}
        try:
            return cls(id=number, data=body, **members)
        except TypeError:  # a required member is missing: keep it as received
            pass
    return UnknownEvent(id=number, data=body, name=name or "message")


def _event_id(raw: str | int | None) -> int | None:
    if raw is None or raw == "":
        return None
    if isinstance(raw, int):
        return raw
    text = raw.strip()
    # ASCII digits only: str.isdigit accepts "²", which int() refuses.
    return int(text) if text.isascii() and text.isdigit() else None


def output_text(response: dict[str, Any]) -> str:
    """The text of a response object's message items, concatenated."""
    return "".join(
        part.get("text", "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )
