"""Following a direct generation for the client of one HTTP request.

A direct response (``TaskKind.DIRECT``) belongs to its connection: if the
client goes away before the answer is delivered, the generation is cancelled
(``cancel_if_left``), unless nobody but this client could want it: a replay
of an idempotent request never cancels (the first request owns the
generation), nor does a keyed synchronous request, whose retry with the same
key is to get the answer. Once delivered, a ``store: false`` answer is
discarded. A replay holds a place under the stream caps while it waits
(``admit_replay``). Every endpoint
that answers directly (LMSP's ``POST /responses`` and the OpenAI-compatible
routes) goes through these functions, whatever shape it sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing

from django.db import DatabaseError

from accounts_app.models import ApiToken
from lmsp_core import protocol
from lmsp_core.http import db_call
from tasks_app import services as task_services
from tasks_app.event_log import StoredEvent
from tasks_app.models import Task
from tasks_app.streams import admit, follow_events

from . import records

log = logging.getLogger(__name__)


def cancels_if_left(idempotency_key: str | None, stream: bool) -> bool:
    """Whether a client that leaves before its answer takes the generation with it:
    yes, unless its request is keyed and synchronous (the retry gets the answer)."""
    return idempotency_key is None or stream


async def accepted(start: Awaitable[Task], cancel_if_left: bool) -> Task:
    """Start a generation even if the client leaves meanwhile, and then stop it
    (when ``cancel_if_left``): the database work cannot be interrupted halfway,
    and nobody would read what it generates."""
    started = asyncio.ensure_future(start)
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        if cancel_if_left:
            started.add_done_callback(_cancel_orphan)
        raise


def _cancel_orphan(started: asyncio.Future) -> None:
    if started.cancelled() or started.exception() is not None:
        return
    task = started.result()
    if not getattr(task, "replayed", False):  # a replay's generation is the first request's
        asyncio.ensure_future(db_call(task_services.cancel_abandoned, task.id))


def _leaving(task: Task, cancel_if_left: bool) -> bool:
    return cancel_if_left and not getattr(task, "replayed", False)


def _nothing_held() -> None:
    pass


def admit_replay(task: Task, token: ApiToken) -> Callable[[], None]:
    """The release of the place a replay holds under the stream caps while it
    waits for the answer (``tasks_app.streams.admit``: ``503 overloaded``
    past them): it follows a generation its first request started and
    answers for, as a follower of a task does, and nothing else bounds how
    many wait at once. A first request's answer holds none: the model's queue
    and the owner's quotas bound those."""
    if getattr(task, "replayed", False):
        return admit(token.pk, token.owner_id)
    return _nothing_held


def _events(
    task: Task, release: Callable[[], None] | None = None
) -> AsyncIterator[StoredEvent | None]:
    """The task's events from the first; those it was created with come from
    the request that created it (a replay's task was read back, without them).
    ``release`` is called once they end (``admit_replay``)."""
    return follow_events(task.id, 0, getattr(task, "events_at_creation", ()), release)


def _delivered_result(task_id: str) -> dict:
    task = Task.objects.select_related("response").get(id=task_id)
    body = protocol.response_object(task.response)
    records.discard_unneeded(delivered_task_id=task_id)
    return body


async def final_result(
    task: Task, cancel_if_left: bool, release: Callable[[], None] | None = None
) -> dict:
    """Wait for the end of a direct generation and return its response object
    (LMSP's shape, whatever its status); cancel it if the client leaves first
    (``cancel_if_left``, and not a replay). ``release``: see ``admit_replay``."""
    try:
        async with aclosing(_events(task, release)) as events:
            async for _ in events:
                pass
    except asyncio.CancelledError:
        if _leaving(task, cancel_if_left):
            await asyncio.shield(db_call(task_services.cancel_abandoned, task.id))
        raise
    return await db_call(_delivered_result, task.id)


async def delivered_events(
    task: Task, cancel_if_left: bool, release: Callable[[], None] | None = None
) -> AsyncIterator[StoredEvent | None]:
    """The events of a direct generation from the first (``None``: time for a
    keep-alive); the generation is cancelled if the stream is not read to the
    end (``cancel_if_left``, and not a replay), and the answer discarded once
    it is, unless it was stored. ``release``: see ``admit_replay``."""
    delivered = client_gone = False
    try:
        async with aclosing(_events(task, release)) as events:
            async for event in events:
                yield event
        delivered = True
    except (asyncio.CancelledError, GeneratorExit):
        # The client is gone: the server cancels the stream (Django does on
        # http.disconnect) or closes it unfinished. Any other error is the
        # server's own: the generation goes on, to be fetched or replayed.
        client_gone = True
        raise
    finally:
        try:
            if delivered:
                await db_call(records.discard_unneeded, delivered_task_id=task.id)
            elif client_gone and _leaving(task, cancel_if_left):
                await asyncio.shield(db_call(task_services.cancel_abandoned, task.id))
        except DatabaseError:  # the stream itself is whole: do not break it now
            log.warning("Could not tidy up after the stream of %s", task.id, exc_info=True)
