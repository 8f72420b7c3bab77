"""Server-sent event streams of a task's log.

Written here rather than with django-eventstream, which was evaluated and
does not fit the protocol: its ids are composite ``channel:id`` strings, it
has no ``after`` parameter, it answers an expired history with a
``stream-reset`` event instead of ``410``, it never closes after a final
event, and it keeps a fixed 24-hour history.

A reader subscribes to the process's event hub before it replays from the
database, so nothing committed in between is missed; published batches are
used directly while their ids follow on from the last one sent, and any gap
(a lost Redis message, a Redis restart) sends the reader back to the
database. Without any wake-up the reader still looks at the database every
``LMSP_STREAM_POLL_SECONDS``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from django.conf import settings

from lmsp_core.http import db_call
from lmsp_core.protocol import FINAL_EVENTS, KEEPALIVE_FRAME, queued_frame, sse_frame

from . import event_reader, fairness
from .models import FINAL_STATUSES
from .notify import hub

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


async def follow(task_id: str, after: int) -> AsyncIterator[bytes]:
    """Frames of every event after ``after``, live ones included, until the
    final event; keep-alive comments while nothing else is sent (``: queued N``
    while the task waits in its queue)."""
    queue = hub.subscribe(task_id)
    last = after
    last_sent = time.monotonic()
    try:
        need_read = True
        while True:
            if need_read:
                need_read = False
                events = await event_reader.read_after(task_id, last)
                for event in events:
                    yield sse_frame(event.id, event.event, event.data)
                    last, last_sent = event.id, time.monotonic()
                    if event.event in FINAL_EVENTS:
                        return
                if events:
                    need_read = True  # there may be more than one page
                    continue
                if await _ended_before(task_id, last):
                    return
            keepalive_in = settings.LMSP_KEEPALIVE_SECONDS - (time.monotonic() - last_sent)
            timeout = max(0.0, min(settings.LMSP_STREAM_POLL_SECONDS, keepalive_in))
            try:
                batch = await asyncio.wait_for(queue.get(), timeout)
            except TimeoutError:
                if time.monotonic() - last_sent >= settings.LMSP_KEEPALIVE_SECONDS:
                    yield await keepalive_frame(task_id)
                    last_sent = time.monotonic()
                need_read = True
                continue
            while batch is not None:
                for event_id, name, data in batch:
                    if event_id <= last:
                        continue
                    if event_id != last + 1:
                        need_read = True  # a gap: the database has what we missed
                        break
                    yield sse_frame(event_id, name, data)
                    last, last_sent = event_id, time.monotonic()
                    if name in FINAL_EVENTS:
                        return
                batch = None if need_read or queue.empty() else queue.get_nowait()
    finally:
        hub.unsubscribe(task_id, queue)


async def keepalive_frame(task_id: str) -> bytes:
    """``: queued N`` (its queue position) while the task waits for a worker,
    ``: keep-alive`` otherwise."""
    position = await db_call(fairness.queue_position_of, task_id)
    return KEEPALIVE_FRAME if position is None else queued_frame(position)


async def _ended_before(task_id: str, last: int) -> bool:
    """True when nothing more can come: the task is final (or gone) and its
    last event is at or before ``last``."""
    position = await event_reader.position(task_id)
    if position is None:
        return True
    return position.status in FINAL_STATUSES and position.last_event_id <= last
