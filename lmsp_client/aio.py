"""The asynchronous LMSP client: the same calls as ``Client``, awaitable.

Both clients run the same sans-I/O core (``_common.py``): the request of
each endpoint, how its answer is read, the state machines of a direct
stream and of a resumable ``follow``, and the loop that runs them
(``common.run``). This module only awaits the I/O; the full description of
each method is on its ``Client`` twin.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
from httpx_sse import EventSource

from . import _common as common
from ._common import ResponseOptions, response_options, takes
from .events import Event

T = TypeVar("T")


class AsyncClient(common.ClientBase[httpx.AsyncClient, httpx.AsyncBaseTransport]):
    """``AsyncClient(base_url, token)``; either may come from ``LMSP_BASE_URL`` /
    ``LMSP_TOKEN``. Use it as an async context manager, or await ``close()``."""

    _http_class = httpx.AsyncClient

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # --- I/O: the only places that send ------------------------------------------

    async def _call(self, request: common.Request[T]) -> T:
        return request.answer(await self._http.request(**request.send))

    def _run(self, stream: common.Stream) -> AsyncIterator[Event]:
        return common.run(stream, self._connect, asyncio.sleep)

    @asynccontextmanager
    async def _connect(self, request: common.Request[Any]) -> AsyncIterator[common.Connection]:
        async with self._http.stream(**request.send) as response:
            if response.is_error:
                await response.aread()
            yield response, EventSource(response).aiter_sse()

    # --- plain requests ----------------------------------------------------------

    async def models(self) -> list[dict[str, Any]]:
        """Awaitable ``Client.models``: the models this service serves."""
        return await self._call(common.models())

    async def model(self, model_id: str) -> dict[str, Any]:
        """Awaitable ``Client.model``: one model."""
        return await self._call(common.model(model_id))

    @takes(response_options)
    async def create_response(self, options: ResponseOptions) -> dict[str, Any]:
        """Awaitable ``Client.create_response``: generate and wait for the whole
        response object."""
        return await self._call(common.create_response(options))

    async def get_response(self, response_id: str) -> dict[str, Any]:
        """Awaitable ``Client.get_response``: a response stored with ``store: true``."""
        return await self._call(common.get_response(response_id))

    @takes(response_options)
    async def create_task(self, options: ResponseOptions) -> dict[str, Any]:
        """Awaitable ``Client.create_task``: queue a durable generation."""
        return await self._call(common.create_task(options))

    async def get_task(self, task_id: str) -> dict[str, Any]:
        """Awaitable ``Client.get_task``: a task and its status."""
        return await self._call(common.get_task(task_id))

    async def cancel(self, task_id: str) -> dict[str, Any]:
        """Awaitable ``Client.cancel``: cancel a task."""
        return await self._call(common.cancel(task_id))

    async def list_tasks(
        self, *, status: str | None = None, limit: int | None = None, after: str | None = None
    ) -> dict[str, Any]:
        """Awaitable ``Client.list_tasks``: one page of the owner's tasks, newest first."""
        return await self._call(common.list_tasks(status, limit, after))

    async def tasks(
        self, *, status: str | None = None, page_size: int = 20
    ) -> AsyncIterator[dict[str, Any]]:
        """``Client.tasks`` as an async iterator: every task of the owner, newest first."""
        after = None
        while True:
            page = await self.list_tasks(status=status, limit=page_size, after=after)
            for task in page["data"]:
                yield task
            after = common.next_cursor(page)
            if after is None:
                return

    # --- streams ------------------------------------------------------------------

    @takes(response_options)
    def stream_response(self, options: ResponseOptions) -> AsyncIterator[Event]:
        """``Client.stream_response`` as an async iterator: generate with
        ``stream: true``; a broken stream raises ``ConnectionLostError``."""
        return self._run(common.DirectStream(options))

    @takes(common.Follow)
    def follow(self, plan: common.Follow) -> AsyncIterator[Event]:
        """``Client.follow`` as an async iterator: every event of a task after
        ``after``, once each and in order, across any drop. ``on_reconnect``
        may also be a coroutine function; it is awaited."""
        return self._run(plan)
