"""The sans-I/O core that the synchronous and the asynchronous client share.

Everything but the I/O lives here, once: configuration, the request of each
endpoint (method, path, body, headers, timeout), how each answer is read,
and the state machines of a direct stream and of a resumable ``follow``
(last id, backoff, ``204``, ``410``, gap checks, when to give up), and the
one loop that runs a stream (``run``). ``Client`` and ``AsyncClient`` keep
only the I/O: how to send, open a stream and sleep.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import random
import time
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
)
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar, cast

import httpx
from httpx_sse import ServerSentEvent

from .errors import ConnectionLostError, LMSPError, ProblemError, problem_error
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


HTTP = TypeVar("HTTP", httpx.Client, httpx.AsyncClient)
TRANSPORT = TypeVar("TRANSPORT", httpx.BaseTransport, httpx.AsyncBaseTransport)


class ClientBase(Generic[HTTP, TRANSPORT]):
    """The constructor of both clients: ``Client`` is a
    ``ClientBase[httpx.Client, httpx.BaseTransport]``, ``AsyncClient`` the same
    over httpx's async client and transport."""

    _http_class: type[HTTP]

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: httpx.Timeout | float | None = None,
        transport: TRANSPORT | None = None,
    ) -> None:
        """``base_url`` and ``token`` default to ``LMSP_BASE_URL`` /
        ``LMSP_TOKEN``; ``timeout`` to 60 s reads (longer than the service's
        keep-alive) and 10 s connects; ``transport`` is httpx's (tests mock it)."""
        self.base_url, token = settings(base_url, token)
        options = client_options(self.base_url, token, timeout)
        self._http: HTTP = self._http_class(**options, transport=transport)  # type: ignore[arg-type]


def settings(base_url: str | None, token: str | None) -> tuple[str, str]:
    """The base URL and token, from the arguments or LMSP_BASE_URL / LMSP_TOKEN."""
    base = base_url or os.environ.get("LMSP_BASE_URL") or DEFAULT_BASE_URL
    secret = token or os.environ.get("LMSP_TOKEN")
    if not secret:
        raise LMSPError("No token: pass token=... or set LMSP_TOKEN.")
    return base.rstrip("/"), secret


def client_options(base_url: str, token: str, timeout: Any) -> dict[str, Any]:
    return {
        "base_url": base_url,
        "headers": {**HEADERS, "Authorization": f"Bearer {token}"},
        "timeout": DEFAULT_TIMEOUT if timeout is None else timeout,
    }


def as_input(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A plain string becomes one user message; a list is sent as given."""
    if isinstance(value, str):
        return [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}
        ]
    return value


def response_body(
    input: str | list[dict[str, Any]],  # noqa: A002 - the protocol's name
    *,
    model: str | None,
    max_output_tokens: int | None,
    temperature: float | None,
    instructions: str | None,
    extra: dict[str, Any],
) -> dict[str, Any]:
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
    body: dict[str, Any] = {
        "model": model or os.environ.get("LMSP_MODEL") or DEFAULT_MODEL,
        "input": items,
    }
    if max_output_tokens is not None:
        body["max_output_tokens"] = max_output_tokens
    if temperature is not None:
        body["temperature"] = temperature
    body.update(extra)
    return body


def write_headers(idempotency_key: str | None) -> dict[str, Any]:
    return {"Idempotency-Key": idempotency_key} if idempotency_key else {}


@dataclass(frozen=True)
class ResponseOptions:
    """What a caller asks of one response, as ``response_options`` took it."""

    input: str | list[dict[str, Any]]
    model: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    instructions: str | None = None
    idempotency_key: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def body(self, **more: Any) -> dict[str, Any]:
        """The request body, with ``more`` members over the caller's ``extra``."""
        return response_body(
            self.input,
            model=self.model,
            max_output_tokens=self.max_output_tokens,
            temperature=self.temperature,
            instructions=self.instructions,
            extra={**self.extra, **more},
        )

    def headers(self, **more: str) -> dict[str, Any]:
        return {**write_headers(self.idempotency_key), **more}


def response_options(
    input: str | list[dict[str, Any]],  # noqa: A002 - the protocol's name
    *,
    model: str | None = None,
    max_output_tokens: int | None = None,
    temperature: float | None = None,
    instructions: str | None = None,
    idempotency_key: str | None = None,
    **extra: Any,
) -> ResponseOptions:
    """The keyword signature of every method that asks for a response
    (``create_response``, ``create_task``, ``stream_response``, sync and async).

    ``input`` is a list of input items, or a string for one user message;
    ``model`` defaults to ``LMSP_MODEL`` or ``smollm2:135m``; ``instructions``
    becomes a leading system message; ``idempotency_key`` makes a retried
    write safe; other request members (``tools``, ``store``, ...) go in
    ``extra``. Members not given are not sent: the service's defaults apply.
    """
    return ResponseOptions(
        input, model, max_output_tokens, temperature, instructions, idempotency_key, extra
    )


P = ParamSpec("P")
R = TypeVar("R")


def takes(
    template: Callable[P, Any],
) -> Callable[[Callable[[Any, Any], R]], Callable[Concatenate[Any, P], R]]:
    """Give a method written as ``(self, options)`` the public signature of
    ``template`` (for callers, ``help()`` and type checkers): the caller's
    arguments go through ``template``, and the method gets what it returns.
    The method keeps its name, docstring and return annotation."""

    def decorate(method: Callable[[Any, Any], R]) -> Callable[Concatenate[Any, P], R]:
        def call(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return method(self, template(*args, **kwargs))

        async def await_call(self: Any, /, *args: Any, **kwargs: Any) -> Any:
            return await call(self, *args, **kwargs)

        public: Any = await_call if inspect.iscoroutinefunction(method) else call
        functools.wraps(method)(public)
        own = inspect.signature(method)
        self_parameter = next(iter(own.parameters.values()))
        public.__signature__ = own.replace(
            parameters=[self_parameter, *inspect.signature(template).parameters.values()]
        )
        return cast("Callable[Concatenate[Any, P], R]", public)

    return decorate


# --- requests: what each endpoint sends, and how its answer is read ------------------

# A generation without streaming sends nothing until it is done.
UNTIL_DONE = httpx.Timeout(None, connect=10.0)


JSON = dict[str, Any]
T = TypeVar("T")


@dataclass(frozen=True)
class Request(Generic[T]):
    """One request of the protocol, before any I/O; ``T`` is what its
    answer gives (``answer``)."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, Any] | None = None
    timeout: Any = httpx.USE_CLIENT_DEFAULT
    member: str | None = None  # the member of the JSON answer returned; None: all of it

    @property
    def send(self) -> dict[str, Any]:
        """The arguments of ``request`` and ``stream``, of httpx's both clients."""
        return {
            "method": self.method,
            "url": API + self.path,
            "json": self.json,
            "params": self.params,
            "headers": self.headers,
            "timeout": self.timeout,
        }

    def answer(self, response: httpx.Response) -> T:
        """What the client's method returns for this answer (already read);
        an error answer raises its problem."""
        check(response)
        body = response.json()
        return cast(T, body if self.member is None else body[self.member])


def models() -> Request[list[JSON]]:
    return Request("GET", "/models", member="data")


def model(model_id: str) -> Request[JSON]:
    return Request("GET", f"/models/{model_id}")


def create_response(options: ResponseOptions) -> Request[JSON]:
    return Request(
        "POST",
        "/responses",
        json=options.body(stream=False),
        headers=options.headers(),
        timeout=UNTIL_DONE,
    )


def get_response(response_id: str) -> Request[JSON]:
    return Request("GET", f"/responses/{response_id}")


def create_task(options: ResponseOptions) -> Request[JSON]:
    task = {"type": "response", "request": options.body()}
    return Request("POST", "/tasks", json=task, headers=options.headers())


def get_task(task_id: str) -> Request[JSON]:
    return Request("GET", f"/tasks/{task_id}")


def cancel(task_id: str) -> Request[JSON]:
    return Request("POST", f"/tasks/{task_id}/cancel")


def list_tasks(status: str | None, limit: int | None, after: str | None) -> Request[JSON]:
    params = {k: v for k, v in (("status", status), ("limit", limit), ("after", after)) if v}
    return Request("GET", "/tasks", params=params)


def next_cursor(page: dict[str, Any]) -> str | None:
    """The cursor of the page after ``page`` of ``list_tasks``; None after the last."""
    after = page.get("next_cursor")
    return after if page.get("has_more") and after else None


def problem_of(response: httpx.Response) -> dict[str, Any]:
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


async def real_events(sse_events: AsyncIterable[ServerSentEvent]) -> AsyncGenerator[Event, None]:
    """Typed events of an SSE stream.

    httpx-sse dispatches a blank line that follows only a comment (our
    ``: keep-alive``) as an empty ``message`` carrying the previous id; the
    SSE standard does not dispatch an event whose data buffer is empty, so
    neither do we.
    """
    async for sse in sse_events:
        if sse.data:
            yield event_of(sse)


def event_of(sse: ServerSentEvent) -> Event:
    return parse_event(sse.event, sse.data, sse.id)


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
    def headers(self) -> dict[str, Any]:
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


# --- streams: what each connection asks, and what each event or drop means ----------

# What the clients' stream loop hands to its stream's ``retry``.
DROPS = (httpx.TransportError, ProblemError, GapError, StreamEnded)


ReconnectCallback = Callable[[Reconnect], object]


class Stream:
    """The plan of one stream of events, across its connections, which
    ``run`` carries out for both clients."""

    on_reconnect: ReconnectCallback | None = None

    def request(self) -> Request[JSON]:
        """The request that opens the next connection."""
        raise NotImplementedError

    def opened(self, response: httpx.Response) -> bool:
        """Whether the answer (an error's body already read) carries events to
        read; an error answer raises its problem."""
        raise NotImplementedError

    def accept(self, event: Event) -> bool:
        """Whether an event received is delivered to the caller."""
        raise NotImplementedError

    def ended(self) -> None:
        """The connection closed before a final event: raise (a drop that
        ``retry`` answers, or the end)."""
        raise NotImplementedError

    def retry(self, error: BaseException) -> Reconnect:
        """After a drop: when and how to reconnect, or raise to give up."""
        raise NotImplementedError


class DirectStream(Stream):
    """A response generated with ``stream: true``: one connection, which the
    generation belongs to, so a drop ends it with ``ConnectionLostError``."""

    def __init__(self, options: ResponseOptions) -> None:
        self.last = 0
        self._request: Request[JSON] = Request(
            "POST",
            "/responses",
            json=options.body(stream=True),
            headers=options.headers(Accept="text/event-stream"),
        )

    def request(self) -> Request[JSON]:
        return self._request

    def opened(self, response: httpx.Response) -> bool:
        check(response)
        return True

    def accept(self, event: Event) -> bool:
        self.last = event.id or self.last
        return True

    def ended(self) -> None:
        raise ConnectionLostError(
            f"the stream ended after event {self.last} without a final event",
            last_event_id=self.last,
        )

    def retry(self, error: BaseException) -> Reconnect:
        if isinstance(error, httpx.TransportError):
            raise ConnectionLostError(
                f"the stream broke after event {self.last} ({error!r}); a direct stream "
                "cannot be resumed",
                last_event_id=self.last,
            ) from error
        raise error


class Follow(Stream):
    """The resume state machine of ``follow``: each connection asks for the
    events after the last one delivered (``Last-Event-ID``); ``204`` means the
    task is final with nothing left; an error answer raises its problem (a
    ``410`` as ``EventHistoryExpiredError``), a retryable one (5xx, 429, ...)
    and a broken, skipping or early-closed stream reconnect after a backoff,
    until ``reconnect_timeout`` seconds pass without progress.

    Its constructor is the public signature of ``follow``, sync and async.
    ``on_reconnect`` is told each ``Reconnect`` before the wait; what it
    returns is awaited if that is awaitable (the sync client cannot wait on
    anything asynchronous: it raises ``RuntimeError`` if that suspends)."""

    def __init__(
        self,
        task_id: str,
        *,
        after: int = 0,
        reconnect_timeout: float | None = 300.0,
        on_reconnect: ReconnectCallback | None = None,
    ) -> None:
        self.task_id = task_id
        self.reconnect_timeout = reconnect_timeout
        self.on_reconnect = on_reconnect
        self.state = Resume(after)
        self.backoff = Backoff()
        self.failing_since: float | None = None

    def request(self) -> Request[JSON]:
        self.state.connections += 1
        return Request("GET", f"/tasks/{self.task_id}/events", headers=self.state.headers)

    def opened(self, response: httpx.Response) -> bool:
        if response.status_code == 204:
            return False
        check(response, after=self.state.last)
        return True

    def accept(self, event: Event) -> bool:
        if not self.state.accept(event):
            return False
        self.backoff.reset()
        self.failing_since = None
        return True

    def ended(self) -> None:
        raise StreamEnded(f"the stream closed after event {self.state.last}")

    def retry(self, error: BaseException) -> Reconnect:
        if isinstance(error, ProblemError) and not is_retryable(error):
            raise error
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        timeout = self.reconnect_timeout
        if timeout is not None and now - self.failing_since > timeout:
            raise ConnectionLostError(
                f"gave up following {self.task_id} after {timeout:g} s "
                f"without progress; last event {self.state.last}: {error}",
                last_event_id=self.state.last,
            ) from error
        delay = self.backoff.next_delay()
        return Reconnect(self.task_id, self.backoff.failures, delay, self.state.last, error)


# --- the one loop that runs a stream, for both clients ------------------------------

Connection = tuple[httpx.Response, AsyncIterable[ServerSentEvent]]
# Opens a connection (an error answer's body read): its answer and its events.
Connect = Callable[[Request[JSON]], AbstractAsyncContextManager[Connection]]


async def run(
    stream: Stream, connect: Connect, sleep: Callable[[float], Awaitable[object]]
) -> AsyncGenerator[Event, None]:
    """The events ``stream`` delivers, across its connections: each
    connection's until a final one; a connection that closes before it, or
    breaks, is a drop that ``stream.retry`` answers (its ``on_reconnect`` is
    told, and awaited if it returns an awaitable), and the next connection
    opens after its delay. ``AsyncClient`` iterates it; ``Client`` runs it
    through ``blocking``, its I/O and sleep blocking rather than suspending."""
    while True:
        try:
            async with connect(stream.request()) as (response, sse_events):
                if not stream.opened(response):
                    return
                async for event in real_events(sse_events):
                    if stream.accept(event):
                        yield event
                        if event.is_final:
                            return
            stream.ended()
        except DROPS as error:
            reconnect = stream.retry(error)
            told = stream.on_reconnect(reconnect) if stream.on_reconnect else None
            if inspect.isawaitable(told):
                await told
            await sleep(reconnect.delay)


async def unblocked(items: Iterable[T]) -> AsyncGenerator[T, None]:
    """A blocking iterator (the sync client's events) as ``run`` reads it."""
    for item in items:
        yield item


async def sleep_blocking(seconds: float) -> None:
    """``time.sleep`` as ``run`` awaits it, for the sync client."""
    time.sleep(seconds)


def blocking(items: AsyncGenerator[T, None]) -> Iterator[T]:
    """The items of an async generator that never suspends (``run`` over the
    sync client's blocking I/O), as a plain iterator; closing it closes
    them."""
    try:
        while True:
            try:
                yield _completed(anext(items))
            except StopAsyncIteration:
                return
    finally:
        _completed(items.aclose())


def _completed(step: Awaitable[T]) -> T:
    """The result of an awaitable that finishes without suspending."""
    steps = step.__await__()
    try:
        steps.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    steps.close()
    raise RuntimeError(
        "the synchronous client was asked to wait on something asynchronous "
        "(an on_reconnect coroutine that awaits?): use AsyncClient"
    )
