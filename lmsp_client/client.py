"""The synchronous LMSP client.

A thin layer over httpx: one method per endpoint, problem documents raised
as exceptions, stream events typed, and ``follow`` which turns a task's
event stream into one uninterrupted iterator however often the connection
(or the web process behind it) drops.

What each request is and what each answer, event or drop means lives once,
without I/O, in ``_common.py``, and so does the loop that runs a stream
(``common.run``, written once with awaits): this module only sends, opens
streams and sleeps, all blocking, so that loop's awaits never suspend and it
runs without an event loop (``common.blocking``). ``AsyncClient``
(``aio.py``) is its awaitable twin over the same core.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
from httpx_sse import EventSource

from . import _common as common
from ._common import ResponseOptions, response_options, takes
from .events import Event

T = TypeVar("T")


class Client(common.ClientBase[httpx.Client, httpx.BaseTransport]):
    """``Client(base_url, token)``; either may come from ``LMSP_BASE_URL`` /
    ``LMSP_TOKEN``. Use it as a context manager, or call ``close()``."""

    _http_class = httpx.Client

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- I/O: the only places that send ------------------------------------------

    def _call(self, request: common.Request[T]) -> T:
        return request.answer(self._http.request(**request.send))

    def _run(self, stream: common.Stream) -> Iterator[Event]:
        return common.blocking(common.run(stream, self._connect, common.sleep_blocking))

    @asynccontextmanager
    async def _connect(self, request: common.Request[Any]) -> AsyncIterator[common.Connection]:
        with self._http.stream(**request.send) as response:
            if response.is_error:
                response.read()
            yield response, common.unblocked(EventSource(response).iter_sse())

    # --- plain requests ----------------------------------------------------------

    def models(self) -> list[dict[str, Any]]:
        """The models this service serves (``GET /models``)."""
        return self._call(common.models())

    def model(self, model_id: str) -> dict[str, Any]:
        """One model (``GET /models/{model_id}``)."""
        return self._call(common.model(model_id))

    @takes(response_options)
    def create_response(self, options: ResponseOptions) -> dict[str, Any]:
        """Generate and wait for the whole response object (``stream: false``).
        ``input`` is a list of input items, or a string for one user message;
        other request members (``tools``, ``store``, ...) go in ``extra``."""
        return self._call(common.create_response(options))

    def get_response(self, response_id: str) -> dict[str, Any]:
        """A response stored with ``store: true``."""
        return self._call(common.get_response(response_id))

    @takes(response_options)
    def create_task(self, options: ResponseOptions) -> dict[str, Any]:
        """Queue a durable generation (``POST /tasks``); returns the task."""
        return self._call(common.create_task(options))

    def get_task(self, task_id: str) -> dict[str, Any]:
        """A task and its status (``GET /tasks/{task_id}``)."""
        return self._call(common.get_task(task_id))

    def cancel(self, task_id: str) -> dict[str, Any]:
        """Cancel a task; a task already final raises ``task_not_cancellable``."""
        return self._call(common.cancel(task_id))

    def list_tasks(
        self, *, status: str | None = None, limit: int | None = None, after: str | None = None
    ) -> dict[str, Any]:
        """One page of the owner's tasks, newest first."""
        return self._call(common.list_tasks(status, limit, after))

    def tasks(self, *, status: str | None = None, page_size: int = 20) -> Iterator[dict[str, Any]]:
        """Every task of the owner, newest first, paging through the cursor."""
        after = None
        while True:
            page = self.list_tasks(status=status, limit=page_size, after=after)
            yield from page["data"]
            after = common.next_cursor(page)
            if after is None:
                return

    # --- streams ------------------------------------------------------------------

    @takes(response_options)
    def stream_response(self, options: ResponseOptions) -> Iterator[Event]:
        """Generate with ``stream: true`` and yield the events as they come.

        A direct stream belongs to its connection: if it breaks, this raises
        ``ConnectionLostError`` (and the service cancels the generation).
        Use ``create_task`` + ``follow`` for output that must survive drops.
        """
        return self._run(common.DirectStream(options))

    @takes(common.Follow)
    def follow(self, plan: common.Follow) -> Iterator[Event]:
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
        return self._run(plan)
