"""Following a direct generation for the client of one HTTP request.

A direct response (``TaskKind.DIRECT``) belongs to its connection: if the
client goes away before the answer is delivered, the generation is cancelled;
once it is delivered, a ``store: false`` answer is discarded. Every endpoint
that answers directly (LMSP's ``POST /responses`` and the OpenAI-compatible
routes) goes through these functions, whatever shape it sends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing

from lmsp_core import protocol
from lmsp_core.http import db_call
from tasks_app import services as task_services
from tasks_app.event_log import StoredEvent
from tasks_app.models import Task
from tasks_app.streams import follow_events

from . import records


async def accepted(start: Awaitable[Task]) -> Task:
    """Start a generation even if the client leaves meanwhile, and then stop it:
    the database work cannot be interrupted halfway, and nobody would read
    what it generates."""
    started = asyncio.ensure_future(start)
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        started.add_done_callback(_cancel_orphan)
        raise


def _cancel_orphan(started: asyncio.Future) -> None:
    if started.cancelled() or started.exception() is not None:
        return
    asyncio.ensure_future(db_call(task_services.cancel_abandoned, started.result().id))


def _delivered_result(task_id: str) -> dict:
    task = Task.objects.select_related("response").get(id=task_id)
    body = protocol.response_object(task.response)
    records.discard_unneeded(delivered_task_id=task_id)
    return body


async def final_result(task_id: str) -> dict:
    """Wait for the end of a direct generation and return its response object
    (LMSP's shape, whatever its status); cancel it if the client leaves first."""
    try:
        async with aclosing(follow_events(task_id, 0)) as events:
            async for _ in events:
                pass
    except asyncio.CancelledError:
        await asyncio.shield(db_call(task_services.cancel_abandoned, task_id))
        raise
    return await db_call(_delivered_result, task_id)


async def delivered_events(task_id: str) -> AsyncIterator[StoredEvent | None]:
    """The events of a direct generation from the first (``None``: time for a
    keep-alive); the generation is cancelled if the stream is not read to the
    end, and the answer discarded once it is, unless it was stored."""
    delivered = False
    try:
        async with aclosing(follow_events(task_id, 0)) as events:
            async for event in events:
                yield event
        delivered = True
    finally:
        if delivered:
            await db_call(records.discard_unneeded, delivered_task_id=task_id)
        else:  # the client went away mid-stream
            await asyncio.shield(db_call(task_services.cancel_abandoned, task_id))
