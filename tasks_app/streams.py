"""Server-sent event streams of a task's log, for thousands of followers.

Written here rather than with django-eventstream, which was evaluated and
does not fit the protocol: its ids are composite ``channel:id`` strings, it
has no ``after`` parameter, it answers an expired history with a
``stream-reset`` event instead of ``410``, it never closes after a final
event, and it keeps a fixed 24-hour history.

A follower is a small generator (``_deliveries``) that remembers the last id
it sent and waits on its task's feed (``tasks_app.feeds``), shared by every
follower of the task in the process; an idle follower makes no query.
Streams are admitted first (``tasks_app.stream_admission``).

Database or Redis errors never end a stream: the feed retries, and the
stream goes on with keep-alives. A stream whose next events were removed by
retention (or whose task was deleted) ends without a final event, so that
the client's reconnect is answered ``410 event_history_expired`` (or 404); a
reader of events (``follow_events``: direct streams, the OpenAI routes) gets
an ``error`` event instead, since it cannot reconnect: no stream that
missed events ever ends as if it were whole. A stream also ends when the
token that opened it is revoked (``tasks_app.stream_access``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any, cast

from asgiref.sync import SyncToAsync
from django.conf import settings

from lmsp_core.errors import problem
from lmsp_core.protocol import FINAL_EVENTS, KEEPALIVE_FRAME, dumps, error_frame, sse_frame

from . import feeds
from .event_log import StoredEvent
from .event_reader import READ_ERRORS
from .stream_access import StreamAccess
from .stream_admission import admitted

log = logging.getLogger(__name__)

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}


def _frames_only(
    deliveries: AsyncGenerator[tuple[bytes, list[StoredEvent]] | bytes, None],
) -> AsyncGenerator[bytes, None]:
    """``_deliveries`` without ``with_events``, as the frames it yields (a cast:
    the same generator)."""
    return cast("AsyncGenerator[bytes, None]", deliveries)


def lmsp_frame(event: StoredEvent | None) -> bytes:
    """The LMSP frame of a followed event; ``None`` is a keep-alive comment.
    The ``error`` event that ends a stream cut short is no event of the log
    and carries no id: a client's last id stays the last event it got."""
    if event is None:
        return KEEPALIVE_FRAME
    if event.event == "error":
        return error_frame(event.data)
    return sse_frame(event.id, event.event, event.data)


def follow_events(
    task_id: str,
    after: int,
    known: Sequence[StoredEvent] = (),
    *,
    access: StreamAccess | None = None,
    whole: bool = False,
    release: Callable[[], None] | None = None,
) -> AsyncGenerator[StoredEvent | None, None]:
    """The events a follower gets, one by one (``None``: time for a
    keep-alive), for readers that speak another stream format than LMSP's
    or cannot reconnect. ``known``: the events of a task this process has
    just created (``TaskFeed.seed``); ``whole``: the task is a direct
    response, whose feed keeps every event for its slow readers;
    ``release``: the stream's admission (``admit``), given back when it ends.

    Ends after the task's final event or, when it cannot get there, with an
    ``error`` event (id 0: not of the log) whose problem says why:
    ``unauthorized`` when ``access`` was taken away, else
    ``event_history_expired`` (events it needed were removed, or the task
    was deleted)."""
    stream = _deliveries(
        task_id, after, True, release=release, known=known, access=access, whole=whole
    )
    return _one_by_one(task_id, admitted(stream, release), access)


async def _one_by_one(
    task_id: str,
    deliveries: AsyncGenerator[tuple[bytes, list[StoredEvent]] | bytes, None],
    access: StreamAccess | None,
) -> AsyncGenerator[StoredEvent | None, None]:
    finished = False
    async with aclosing(deliveries) as delivered:
        async for delivery in delivered:
            if isinstance(delivery, bytes):
                yield None
                continue
            for event in delivery[1]:
                finished = event.event in FINAL_EVENTS
                yield event
    if not finished:
        yield StoredEvent(0, "error", dumps({"error": _cut_short(task_id, access)}))


def _cut_short(task_id: str, access: StreamAccess | None) -> dict[str, Any]:
    if access is not None and access.ended:
        return problem(
            "unauthorized",
            "The token of this stream was revoked or has expired, or its account was "
            "deactivated; the stream cannot continue.",
        )
    return problem(
        "event_history_expired",
        f"Events of {task_id} this stream still needed were removed (by retention, or "
        "with the response); it cannot continue.",
    )


async def _deliveries(
    task_id: str,
    after: int,
    with_events: bool,
    release: Callable[[], None] | None = None,
    known: Sequence[StoredEvent] = (),
    access: StreamAccess | None = None,
    whole: bool = False,
) -> AsyncGenerator[tuple[bytes, list[StoredEvent]] | bytes, None]:
    """What a follower is sent: frames joined in one chunk (with
    ``with_events``, as a pair with the events they carry), or a keep-alive
    comment when one is due. The frames of the window are joined once for
    every follower standing at the same id. One generator per follower, the
    only object a waiting stream holds besides its connection (and its
    ``access``, which ends it when taken away); ``release`` is called when
    it ends. Ends after the task's final event, or early, without one, when
    the events it needs are gone or its access ended (a reconnect is then
    told why: 410, 404 or 401)."""
    feed = feeds.acquire(task_id, known, whole)
    loop = asyncio.get_running_loop()
    waiter = feeds.Waiter()
    if access is not None:
        access.open(waiter.wake)
    keepalive = settings.LMSP_KEEPALIVE_SECONDS
    sent = after
    quiet_since = time.monotonic()
    backoff = 0.2
    parked = False
    try:
        while access is None or not access.ended:
            if feed.ready and not feed.ends_at(sent):
                if sent < feed.base:  # before the window: replay from the database
                    if sent < feed.pruned_through:
                        return
                    try:
                        rows = await feed.page(sent)
                    except READ_ERRORS as exc:
                        log.warning("Replay of %s failed (%s); retrying", task_id, exc)
                        rows = None
                    if rows is not None:
                        backoff = 0.2
                        rows = [event for event in rows if event.id > sent]
                        if not rows or rows[0].id != sent + 1:
                            return  # removed by retention since the feed looked
                        frames = b"".join(sse_frame(e.id, e.event, e.data) for e in rows)
                        yield (frames, rows) if with_events else frames
                        sent, quiet_since = rows[-1].id, time.monotonic()
                        if rows[-1].event in FINAL_EVENTS and feed.ends_at(sent):
                            return
                        continue
                elif sent < feed.last:
                    frames = feed.frames_after(sent)
                    delivery = (frames, feed.events_after(sent)) if with_events else frames
                    sent = feed.last
                    yield delivery
                    quiet_since = time.monotonic()
                    continue
            elif feed.ready:
                return
            quiet = time.monotonic() - quiet_since
            if quiet >= keepalive:
                yield feed.keepalive_frame()
                quiet_since = time.monotonic()
                continue
            if feed.ready and sent < feed.base:  # a failed replay read: wait, then again
                await asyncio.sleep(min(backoff, keepalive - quiet))
                backoff = min(backoff * 2, feeds.RETRY_MAX_SECONDS)
                continue
            if not parked:
                _park_request_thread()
                parked = True
            await feed.changed(waiter, loop.time() + keepalive - quiet)
    finally:
        feed.forget(waiter)
        feeds.release(feed)
        if access is not None:
            access.close()
        if release is not None:
            release()


def _park_request_thread() -> None:
    """Let the thread Django keeps for this request go while the stream waits.

    Django's ASGI handler runs every request in asgiref's
    ``ThreadSensitiveContext``: the sync hooks of the middleware run in a
    thread of the request's own, which lives until the response is sent,
    for a stream its whole life (measured: about 45 KiB of RSS and one OS
    thread per open stream). A waiting stream runs no sync code; should the
    request need its thread again (closing the response), asgiref starts a
    new one. The middleware still runs for every request, as before.
    """
    context = SyncToAsync.thread_sensitive_context.get(None)
    if context is None or getattr(context, "_executor", None) is not None:
        return  # not Django's context, or an executor someone else owns
    executor = SyncToAsync.context_to_thread_executor.pop(context, None)
    if executor is not None:
        executor.shutdown(wait=False)


def admitted_stream(
    task_id: str, after: int, release: Callable[[], None], access: StreamAccess | None = None
) -> AsyncGenerator[bytes, None]:
    """The frames of every event after ``after``, live ones included, until the
    final event, with keep-alive comments while nothing else is sent
    (``: queued N`` while the task waits in its queue); ends early, without a
    final event, when the events it needs are gone or ``access`` ended.
    Gives its admission back when it ends."""
    stream = _deliveries(task_id, after, with_events=False, release=release, access=access)
    return admitted(_frames_only(stream), release)
