"""Following a direct generation for the client of one HTTP request.

A direct response (``TaskKind.DIRECT``) belongs to its connection: if the
client goes away before the answer is delivered, the generation is cancelled
(``cancel_if_left``), unless nobody but this client could want it: a replay
of an idempotent request never cancels (the first request owns the
generation), nor does a keyed synchronous request, whose retry with the same
key is to get the answer. A client whose token is revoked meanwhile is
treated as one that left (``tasks_app.stream_access``). Once delivered, a
``store: false`` answer is discarded. Its reader never misses a part of
it: the task's feed keeps all its events while it is read
(``follow_events(whole=True)``), and a stream that still cannot get to its
end (the response was deleted) ends with an ``error`` event, never as if
it were whole. A replay holds a place under the stream caps while it waits
(``admit_replay``). Every endpoint that answers directly (LMSP's ``POST
/responses`` and the OpenAI-compatible routes) goes through these
functions, whatever shape it sends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from django.db import DatabaseError

from accounts_app.models import ApiToken
from lmsp_core import protocol
from lmsp_core.errors import ProblemError, unauthorized
from lmsp_core.http import db_call
from tasks_app import services as task_services
from tasks_app.event_log import StoredEvent
from tasks_app.models import Task
from tasks_app.stream_access import StreamAccess
from tasks_app.stream_admission import admit
from tasks_app.streams import follow_events

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


def _cancel_orphan(started: asyncio.Future[Task]) -> None:
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
    waits for the answer (``tasks_app.stream_admission.admit``: ``503 overloaded``
    past them): it follows a generation its first request started and
    answers for, as a follower of a task does, and nothing else bounds how
    many wait at once. A first request's answer holds none: the model's queue
    and the owner's quotas bound those."""
    if getattr(task, "replayed", False):
        return admit(token.pk, token.owner_id)
    return _nothing_held


def _events(
    task: Task, access: StreamAccess, release: Callable[[], None] | None
) -> AsyncGenerator[StoredEvent | None, None]:
    """The task's events from the first, all kept for this reader, ending
    with a final or an ``error`` event; those it was created with come from
    the request that created it (a replay's task was read back, without them).
    ``release`` is called once they end (``admit_replay``)."""
    known = getattr(task, "events_at_creation", ())
    return follow_events(task.id, 0, known, access=access, whole=True, release=release)


def _delivered_result(task_id: str) -> dict[str, Any]:
    task = Task.objects.select_related("response").get(id=task_id)
    body = protocol.response_object(task.response)
    records.discard_delivered(task_id)
    return body


async def final_result(
    task: Task,
    cancel_if_left: bool,
    access: StreamAccess,
    release: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Wait for the end of a direct generation and return its response object
    (LMSP's shape, whatever its status); cancel it if the client leaves first
    (``cancel_if_left``, and not a replay) or its ``access`` ends (then 401).
    A response deleted meanwhile is 404. ``release``: see ``admit_replay``."""
    last = None
    try:
        async with aclosing(_events(task, access, release)) as events:
            async for event in events:
                last = event or last
    except asyncio.CancelledError:
        if _leaving(task, cancel_if_left):
            await asyncio.shield(db_call(task_services.cancel_abandoned, task.id))
        raise
    if last is not None and last.event == "error":  # it could not be followed to its end
        if not access.ended:
            raise ProblemError("response_not_found", "The response was deleted meanwhile.")
        if _leaving(task, cancel_if_left):
            await db_call(task_services.cancel_abandoned, task.id)
        raise unauthorized("The bearer token was revoked or expired, or its account deactivated.")
    body: dict[str, Any] = await db_call(_delivered_result, task.id)
    return body


async def delivered_events(
    task: Task,
    cancel_if_left: bool,
    access: StreamAccess,
    release: Callable[[], None] | None = None,
) -> AsyncGenerator[StoredEvent | None, None]:
    """The events of a direct generation from the first (``None``: time for a
    keep-alive), ending with a final event, or an ``error`` event when it
    cannot get there (``follow_events``); the generation is cancelled if the
    stream is not read to the end or its ``access`` ends (``cancel_if_left``,
    and not a replay), and the answer discarded once it is delivered, unless
    it was stored. ``release``: see ``admit_replay``."""
    delivered = client_gone = False
    last = None
    try:
        async with aclosing(_events(task, access, release)) as events:
            async for event in events:
                yield event
                last = event or last
        delivered = last is not None and last.event != "error"
        client_gone = access.ended
    except (asyncio.CancelledError, GeneratorExit):
        # The client is gone: the server cancels the stream (Django does on
        # http.disconnect) or closes it unfinished. Any other error is the
        # server's own: the generation goes on, to be fetched or replayed.
        client_gone = True
        raise
    finally:
        try:
            if delivered:
                await db_call(records.discard_delivered, task.id)
            elif client_gone and _leaving(task, cancel_if_left):
                await asyncio.shield(db_call(task_services.cancel_abandoned, task.id))
        except DatabaseError:  # the stream itself is whole: do not break it now
            log.warning("Could not tidy up after the stream of %s", task.id, exc_info=True)
