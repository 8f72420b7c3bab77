"""What the synchronous and the asynchronous client share: configuration,
request bodies, error answers and the bookkeeping of a resumable follow.
Kept free of I/O so that both clients behave the same way."""

from __future__ import annotations

import json
import os
import random
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import ServerSentEvent

from .errors import LMSPError, ProblemError, problem_error
from .events import Event, parse_event

API = "/lmsp/v1"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_MODEL = "smollm2:135m"
# Reads wait longer than the service's keep-alive interval (15 s): a stream
# that stays silent past it is a dead connection, and follow() reconnects.
DEFAULT_TIMEOUT = httpx.Timeout(60.0, connect=10.0)
HEADERS = {"LMSP-Version": "1.0", "User-Agent": "lmsp-client/0.1"}
# Answers that say "try again" rather than "this request is wrong".
RETRYABLE_STATUSES = frozenset({408, 425, 429, 500, 502, 503, 504})


def settings(base_url: str | None, token: str | None) -> tuple[str, str]:
    """The base URL and token, from the arguments or LMSP_BASE_URL / LMSP_TOKEN."""
    base = base_url or os.environ.get("LMSP_BASE_URL") or DEFAULT_BASE_URL
    secret = token or os.environ.get("LMSP_TOKEN")
    if not secret:
        raise LMSPError("No token: pass token=... or set LMSP_TOKEN.")
    return base.rstrip("/"), secret


def client_options(base_url: str, token: str, timeout: Any) -> dict:
    return {
        "base_url": base_url,
        "headers": {**HEADERS, "Authorization": f"Bearer {token}"},
        "timeout": DEFAULT_TIMEOUT if timeout is None else timeout,
    }


def as_input(value: str | list[dict]) -> list[dict]:
    """A plain string becomes one user message; a list is sent as given."""
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    return value


def response_body(
    input: str | list[dict],  # noqa: A002 - the protocol's name
    *,
    model: str | None,
    max_output_tokens: int | None,
    temperature: float | None,
    instructions: str | None,
    extra: dict,
) -> dict:
    """A responses request: only the members given are sent, the service's
    defaults apply to the rest. ``instructions`` becomes a leading system message."""
    items = as_input(input)
    if instructions:
        system = {
            "type": "message",
            "role": "system",
            "content": [{"type": "input_text", "text": instructions}],
        }
        items = [system, *items]
    body: dict = {"model": model or os.environ.get("LMSP_MODEL") or DEFAULT_MODEL, "input": items}
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra)
    return body


def write_headers(idempotency_key: str | None) -> dict:
    return {"Idempotency-Key": idempotency_key} if idempotency_key else {}


def problem_of(response: httpx.Response) -> dict:
    """The problem document of an error answer (already read). An answer that is
    not one (a proxy's HTML page) still becomes a problem-shaped dict."""
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    if isinstance(body, dict) and ("code" in body or "type" in body):
        return body
    return {
        "type": "about:blank",
        "title": response.reason_phrase or "HTTP error",
        "status": response.status_code,
        "detail": response.text[:500] if response.content else None,
        "code": None,
    }


def check(response: httpx.Response, after: int | None = None) -> None:
    """Raise the problem of an error answer (already read)."""
    if response.status_code >= 400:
        raise problem_error(problem_of(response), response.status_code, after=after)


def is_retryable(error: BaseException) -> bool:
    """Worth reconnecting: the connection broke, or the service said try later."""
    if isinstance(error, httpx.TransportError):  # includes httpx_sse.SSEError
        return True
    return isinstance(error, ProblemError) and error.status in RETRYABLE_STATUSES


def real_events(sse_events: Iterable[ServerSentEvent]) -> Iterator[Event]:
    """Typed events of an SSE stream.

    httpx-sse dispatches a blank line that follows only a comment (our
    ``: keep-alive``) as an empty ``message`` carrying the previous id; the
    SSE standard does not dispatch an event whose data buffer is empty, so
    neither do we.
    """
    for sse in sse_events:
        if sse.data:
            yield parse_event(sse.event, sse.data, sse.id)


async def areal_events(sse_events: AsyncIterable[ServerSentEvent]) -> AsyncIterator[Event]:
    """``real_events`` for an async stream."""
    async for sse in sse_events:
        if sse.data:
            yield parse_event(sse.event, sse.data, sse.id)


@dataclass
class Backoff:
    """Exponential backoff with jitter between reconnects."""

    initial: float = 0.25
    maximum: float = 5.0
    factor: float = 2.0
    failures: int = 0

    def next_delay(self) -> float:
        delay = min(self.maximum, self.initial * self.factor**self.failures)
        self.failures += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


class Resume:
    """The state of one follow across connections: the last id delivered.

    ``accept`` says whether an event received is the next one to deliver;
    an id already delivered is dropped (never twice), and an id beyond the
    next one means something was skipped, so the connection is abandoned and
    resumed from the last id delivered (never a gap).
    """

    def __init__(self, after: int) -> None:
        self.last = after
        self.connections = 0

    @property
    def headers(self) -> dict:
        return {"Last-Event-ID": str(self.last), "Accept": "text/event-stream"}

    def accept(self, event: Event) -> bool:
        if event.id is None:  # not a protocol event of a task stream
            return False
        if event.id <= self.last:
            return False
        if event.id != self.last + 1:
            raise GapError(f"event {event.id} arrived after {self.last}")
        self.last = event.id
        return True


class GapError(LMSPError):
    """A stream skipped an id: resume from the last one delivered."""


class StreamEnded(LMSPError):
    """A stream closed before its final event: resume from the last one delivered."""


@dataclass(frozen=True)
class Reconnect:
    """What ``follow`` tells its ``on_reconnect`` callback before it waits
    ``delay`` seconds and resumes after ``last_event_id``."""

    task_id: str
    attempt: int
    delay: float
    last_event_id: int
    error: BaseException
