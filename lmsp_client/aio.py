"""The asynchronous LMSP client: the same calls as ``Client``, awaitable.

Kept as a line-by-line twin of ``client.py`` (I/O awaited, iterators
asynchronous) so that both behave the same way; what they share without I/O
lives in ``_common.py``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from httpx_sse import EventSource

from . import _common as common
from ._common import API, Backoff, GapError, Reconnect, Resume, StreamEnded, check
from .errors import ConnectionLostError, ProblemError
from .events import Event

ReconnectCallback = Callable[[Reconnect], object]


class AsyncClient:
    """``AsyncClient(base_url, token)``; either may come from ``LMSP_BASE_URL`` /
    ``LMSP_TOKEN``. Use it as an async context manager, or await ``close()``."""

    def __init__(
        self,
        base_url: str | None = None,
        token: str | None = None,
        *,
        timeout: httpx.Timeout | float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url, token = common.settings(base_url, token)
        self._http = httpx.AsyncClient(
            **common.client_options(self.base_url, token, timeout), transport=transport
        )

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # --- plain requests ----------------------------------------------------------

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self._http.request(method, API + path, **kwargs)
        check(response)
        return response

    async def models(self) -> list[dict]:
        """The models this service serves (``GET /models``)."""
        return (await self._call("GET", "/models")).json()["data"]

    async def model(self, model_id: str) -> dict:
        return (await self._call("GET", f"/models/{model_id}")).json()

    async def create_response(
        self,
        input: str | list[dict],  # noqa: A002 - the protocol's name
        *,
        model: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        instructions: str | None = None,
        idempotency_key: str | None = None,
        **extra: Any,
    ) -> dict:
        """Generate and wait for the whole response object (``stream: false``).
        ``input`` is a list of input items, or a string for one user message;
        other request members (``tools``, ``store``, ...) go in ``extra``."""
        body = common.response_body(
            input,
            model=model,
            max_output_tokens=max_output_tokens,
            temperature=temperature,
            instructions=instructions,
            extra={**extra, "stream": False},
        )
        return (
            await self._call(
                "POST",
                "/responses",
                json=body,
                headers=common.write_headers(idempotency_key),
                timeout=httpx.Timeout(None, connect=10.0),  # nothing is sent until it is done
            )
        ).json()

    async def get_response(self, response_id: str) -> dict:
        """A response stored with ``store: true``."""
        return (await self._call("GET", f"/responses/{response_id}")).json()

    async def create_task(
        self,
        input: str | list[dict],  # noqa: A002
        *,
        model: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        instructions: str | None = None,
        idempotency_key: str | None = None,
        **extra: Any,
    ) -> dict:
        """Queue a durable generation (``POST /tasks``); returns the task."""
        request = common.response_body(
            input,
            model=model,
            max_output_tokens=max_output_tokens,
            temperature=temperature,
            instructions=instructions,
            extra=extra,
        )
        return (
            await self._call(
                "POST",
                "/tasks",
                json={"type": "response", "request": request},
                headers=common.write_headers(idempotency_key),
            )
        ).json()

    async def get_task(self, task_id: str) -> dict:
        return (await self._call("GET", f"/tasks/{task_id}")).json()

    async def cancel(self, task_id: str) -> dict:
        """Cancel a task; a task already final raises ``task_not_cancellable``."""
        return (await self._call("POST", f"/tasks/{task_id}/cancel")).json()

    async def list_tasks(
        self, *, status: str | None = None, limit: int | None = None, after: str | None = None
    ) -> dict:
        """One page of the owner's tasks, newest first."""
        params = {k: v for k, v in (("status", status), ("limit", limit), ("after", after)) if v}
        return (await self._call("GET", "/tasks", params=params)).json()

    async def tasks(self, *, status: str | None = None, page_size: int = 20) -> AsyncIterator[dict]:
        """Every task of the owner, newest first, paging through the cursor."""
        after = None
        while True:
            page = await self.list_tasks(status=status, limit=page_size, after=after)
            for task in page["data"]:
                yield task
            after = page.get("next_cursor")
            if not page.get("has_more") or not after:
                return

    # --- streams ------------------------------------------------------------------

    async def stream_response(
        self,
        input: str | list[dict],  # noqa: A002
        *,
        model: str | None = None,
        max_output_tokens: int | None = None,
        temperature: float | None = None,
        instructions: str | None = None,
        idempotency_key: str | None = None,
        **extra: Any,
    ) -> AsyncIterator[Event]:
        """Generate with ``stream: true`` and yield the events as they come.

        A direct stream belongs to its connection: if it breaks, this raises
        ``ConnectionLostError`` (and the service cancels the generation).
        Use ``create_task`` + ``follow`` for output that must survive drops.
        """
        body = common.response_body(
            input,
            model=model,
            max_output_tokens=max_output_tokens,
            temperature=temperature,
            instructions=instructions,
            extra={**extra, "stream": True},
        )
        headers = {**common.write_headers(idempotency_key), "Accept": "text/event-stream"}
        last = 0
        try:
            async with self._http.stream(
                "POST", API + "/responses", json=body, headers=headers
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    check(response)
                async for event in common.areal_events(EventSource(response).aiter_sse()):
                    last = event.id or last
                    yield event
                    if event.is_final:
                        return
        except httpx.TransportError as error:
            raise ConnectionLostError(
                f"the stream broke after event {last} ({error!r}); a direct stream cannot "
                "be resumed",
                last_event_id=last,
            ) from error
        raise ConnectionLostError(
            f"the stream ended after event {last} without a final event", last_event_id=last
        )

    async def follow(
        self,
        task_id: str,
        *,
        after: int = 0,
        reconnect_timeout: float | None = 300.0,
        on_reconnect: ReconnectCallback | None = None,
    ) -> AsyncIterator[Event]:
        """Every event of a task after ``after``, once each and in order, until
        its final event.

        After any drop (broken connection, web restart, a 5xx answer, a stream
        that ends early) it waits with exponential backoff and reconnects
        with ``Last-Event-ID`` set to the last id it yielded. ``204`` means the
        task is final and nothing is left: the iterator ends. It gives up with
        ``ConnectionLostError`` after ``reconnect_timeout`` seconds without
        progress (``None``: never). A pruned history raises
        ``EventHistoryExpiredError``; other problems raise ``ProblemError``.
        """
        state = Resume(after)
        backoff = Backoff()
        failing_since: float | None = None
        url = f"{API}/tasks/{task_id}/events"
        while True:
            try:
                state.connections += 1
                async with self._http.stream("GET", url, headers=state.headers) as response:
                    if response.status_code == 204:
                        return
                    if response.status_code >= 400:
                        await response.aread()
                        check(response, after=state.last)
                    async for event in common.areal_events(EventSource(response).aiter_sse()):
                        if not state.accept(event):
                            continue
                        backoff.reset()
                        failing_since = None
                        yield event
                        if event.is_final:
                            return
                raise StreamEnded(f"the stream closed after event {state.last}")
            except (httpx.TransportError, ProblemError, GapError, StreamEnded) as error:
                if isinstance(error, ProblemError) and not common.is_retryable(error):
                    raise
                now = time.monotonic()
                failing_since = failing_since or now
                if reconnect_timeout is not None and now - failing_since > reconnect_timeout:
                    raise ConnectionLostError(
                        f"gave up following {task_id} after {reconnect_timeout:g} s "
                        f"without progress; last event {state.last}: {error}",
                        last_event_id=state.last,
                    ) from error
                delay = backoff.next_delay()
                if on_reconnect is not None:
                    outcome = on_reconnect(
                        Reconnect(task_id, backoff.failures, delay, state.last, error)
                    )
                    if asyncio.iscoroutine(outcome):
                        await outcome
                await asyncio.sleep(delay)
