"""The feeds behind event streams: one ``TaskFeed`` per followed task and
web process, shared by all the task's followers (``tasks_app.streams``).

Followers cost memory, not queries. A feed is a window of the task's most
recent events as ready-made SSE frames, filled from the Redis messages the
process's one subscription receives (``tasks_app.notify``) and, on a gap in
ids, on (re)connecting to Redis or while Redis is down, by one database read
shared by every follower of the task. While Redis is healthy an idle feed
makes no query at all. A slow safety check per process
(``LMSP_STREAM_CHECK_SECONDS``, ``feed_watch``), not per feed or follower,
catches a lost message (a final one included): one query reads where the
tasks of all the process's feeds stand, and only a feed whose task moved on
without telling it (or whose place in the queue went down) reads it again.

A follower that starts before the window (a late joiner, a resume far back)
replays from the database in pages of ``LMSP_STREAM_PAGE_EVENTS``
(``TaskFeed.page``); pages are read once and shared by the followers that
need them at the same time. Database or Redis errors never end a feed: it
retries.

The feed of a direct response (``whole``) keeps all its events rather than a
window: its reader may fall behind while its client reads slowly, and once
the answer is over it is discarded from the database (``store: false``),
so its reader could not page back to what it missed. An answer has about
as many events as output tokens, at most ``max_output_tokens``.

A task re-queued after it failed (``lifecycle.requeue_failed``) goes on
after its ``response.failed``: that final event ends the streams of the
failed run, but no longer counts as the task's end once a later event
follows it, so a reader resuming after it gets the new run.

Kept apart from the streams so that what one follower does (``streams``)
reads apart from what all of a task's followers share (here).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from django.conf import settings

from lmsp_core.http import db_call
from lmsp_core.protocol import FINAL_EVENTS, KEEPALIVE_FRAME, queued_frame, sse_frame
from lmsp_core.status import FINAL_STATUSES, Status

from . import event_reader, fairness, stream_access
from .event_log import StoredEvent
from .event_reader import READ_ERRORS
from .feed_watch import FeedWatch
from .notify import Batch, hub

log = logging.getLogger(__name__)

RETRY_MAX_SECONDS = 5.0

# How long a feed's task must have been queued before the feed reads its place
# in the queue (it goes out only in keep-alive comments). A task a worker takes
# at once never needs it, and the read is a write in PostgreSQL that would run
# beside the worker's claim, on the way to the first token.
QUEUE_POSITION_AFTER_SECONDS = 0.25


class _Vanished(Exception):
    """Events the feed was about to read were removed meanwhile (retention)."""


class Waiter:
    """One follower's waits on its feed: the future that the feed resolves
    when something changes, and the timer that resolves it when a keep-alive
    is due. The timer is kept from wait to wait and set again only when it
    fires before the keep-alive is due (events came meanwhile): making and
    cancelling a timer for every wait cost more than all else a woken
    follower does (``bench/README.md``, bench_fanout.py)."""

    __slots__ = ("future", "timer", "due")

    def __init__(self) -> None:
        self.future: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.due = 0.0

    def wake(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    def _expire(self) -> None:
        self.timer = None
        self.wake()

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


class TaskFeed:
    """The events of one task as this process knows them, shared by its followers.

    ``frames`` holds the frames of ids ``base + 1 .. last``; ids up to
    ``pruned_through`` were removed by retention and can never be sent.
    Followers wait on ``changed()``, which resolves whenever frames are added
    or the feed learns something that ends streams.
    """

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.whole = False  # keep every event, not a window (a direct response's)
        self.frames: list[bytes] = []
        self.events: list[StoredEvent] = []  # the same events, for follow_events
        self.base = 0
        self.last = 0  # base + len(frames)
        self.final_id: int | None = None  # id of the final event, once known
        self.task_final = False
        self.task_queued = False  # as the last read saw it, until an event says otherwise
        self.queue_position: int | None = None  # read with the position while queued
        self.pruned_through = 0
        self.gone = False  # the task itself was deleted
        self.ready = False  # the first read is done
        self.followers = 0
        self.closed = False
        self._waiting: dict[Waiter, None] = {}
        self._wake = asyncio.Event()
        self._need_read = True
        self._pending: list[Batch] = []  # messages that came before the first read
        self._joined: dict[int, bytes] = {}  # frames after id N, joined, for this `last`
        self._pages: dict[int, asyncio.Future[list[StoredEvent]]] = {}
        loop = asyncio.get_running_loop()
        self._position_due = loop.time() + QUEUE_POSITION_AFTER_SECONDS
        self._runner = loop.create_task(self._run(), name=f"lmsp-feed-{task_id}")

    # --- the followers' side -------------------------------------------------------

    def changed(self, waiter: Waiter, until: float) -> asyncio.Future[None]:
        """A future resolved when the feed changes, or at loop time ``until``
        (or before, when the follower's timer was set for an earlier
        keep-alive). A follower waits in one place at a time: a new wait
        replaces its last one, woken or not."""
        loop = asyncio.get_running_loop()
        if waiter.timer is None or waiter.due > until:
            waiter.cancel()
            waiter.timer = loop.call_at(until, waiter._expire)
            waiter.due = until
        waiter.future = future = loop.create_future()
        self._waiting[waiter] = None
        return future

    def forget(self, waiter: Waiter) -> None:
        """A follower that ends waits no more."""
        waiter.cancel()
        self._waiting.pop(waiter, None)

    def frames_after(self, sent: int) -> bytes:
        """The frames of ids ``sent + 1 .. last`` as one chunk (``sent >= base``),
        built once for all the followers that stand at the same id."""
        joined = self._joined.get(sent)
        if joined is None:
            start = sent - self.base
            joined = (
                self.frames[start]
                if start == len(self.frames) - 1
                else b"".join(self.frames[start:])
            )
            self._joined[sent] = joined
        return joined

    def keepalive_frame(self) -> bytes:
        """``: queued N`` while the task waits in its queue, ``: keep-alive``
        otherwise: the position comes with the feed's own reads (``_refresh``),
        so keep-alives cost no query."""
        if self.task_queued and self.queue_position is not None:
            return queued_frame(self.queue_position)
        return KEEPALIVE_FRAME

    def events_after(self, sent: int) -> list[StoredEvent]:
        """The events of ids ``sent + 1 .. last`` (``sent >= base``)."""
        return self.events[sent - self.base :]

    def ends_at(self, sent: int) -> bool:
        """True when nothing can follow id ``sent``: the task's final event
        is sent (its events up to it are here), or the task is gone."""
        if self.final_id is not None:
            return sent >= self.final_id
        return self.gone or (self.task_final and sent >= self.last)

    async def page(self, after: int) -> list[StoredEvent]:
        """Stored events from the page that holds ``after + 1``, read once for
        every follower that needs it now; complete pages stay cached."""
        size = settings.LMSP_STREAM_PAGE_EVENTS
        index = after // size
        future = self._pages.get(index)
        if future is None or (future.done() and (future.cancelled() or future.exception())):
            future = asyncio.ensure_future(
                event_reader.read_range(self.task_id, index * size, (index + 1) * size)
            )
            self._pages[index] = future
            future.add_done_callback(lambda done: self._page_read(index, done, size))
        return await asyncio.shield(future)

    def _page_read(self, index: int, future: asyncio.Future[list[StoredEvent]], size: int) -> None:
        complete = (
            not future.cancelled() and future.exception() is None and len(future.result()) == size
        )
        if not complete and self._pages.get(index) is future:
            del self._pages[index]  # a short page may grow, a failed read is retried
        while len(self._pages) > 4:
            del self._pages[next(iter(self._pages))]

    # --- filling -------------------------------------------------------------------

    def on_message(self, events: Batch) -> None:
        """A batch published by a writer: ``[(id, event, data), ...]``; none:
        the task changed otherwise (``notify.publish_changed``), read it."""
        if self.closed:
            return
        if not events:
            self.request_read()
            return
        if not self.ready:
            self._pending.append(events)
            return
        self._apply(events)

    def seed(self, events: Sequence[StoredEvent]) -> None:
        """Start a new feed from the events its task was created with, known
        to the process that created it, instead of reading them back: the
        read would run beside the worker's claim of the task, on the way to
        its first token. The hub listens already; a message sent before it
        did leaves a gap that the next message (or the position read, due
        while the task is queued) fills from the database."""
        if self.ready or not events:  # only a new feed starts from them
            return
        self._restart_window(events[0].id - 1)
        for event in events:
            self._append(event.id, event.event, event.data)
        self.task_queued = True
        self._need_read = False
        self.ready = True

    def request_read(self) -> None:
        self._need_read = True
        self._wake.set()

    def close(self) -> None:
        self.closed = True
        self._runner.cancel()
        self._pages.clear()

    def _notify(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for waiter in waiting:
            waiter.wake()

    def _apply(self, events: Sequence[Sequence[Any]]) -> None:
        added = False
        for event_id, name, data in events:
            if event_id <= self.last:
                continue
            if event_id != self.last + 1:
                self.request_read()  # a gap: the database has what was missed
                break
            self._append(event_id, name, data)
            added = True
        if added:
            self.task_queued = False  # a worker writes the events after the first
            self._notify()

    def _append(self, event_id: int, name: str, data: str) -> None:
        self.frames.append(sse_frame(event_id, name, data))
        self.events.append(StoredEvent(event_id, name, data))
        self.last = event_id
        if name in FINAL_EVENTS:
            self.final_id = event_id
        elif self.final_id is not None or self.task_final:
            # A failed task was re-queued: its old end is not the task's end.
            self.final_id = None
            self.task_final = False
            self._wake.set()  # the feed's checks resume
        self._joined.clear()
        window = settings.LMSP_STREAM_WINDOW_EVENTS
        if not self.whole and len(self.frames) > window + window // 4:
            drop = len(self.frames) - window
            del self.frames[:drop]
            del self.events[:drop]
            self.base += drop

    def _restart_window(self, base: int) -> None:
        self.frames = []
        self.events = []
        self.base = self.last = base
        self._joined.clear()

    async def _run(self) -> None:
        backoff = 0.2
        while not self.closed:
            if self._need_read:
                self._need_read = False
                try:
                    await self._refresh()
                    backoff = 0.2
                except _Vanished:
                    self._need_read = True  # read the position again: it says what is gone
                    await asyncio.sleep(0.05)
                    continue
                except READ_ERRORS as exc:
                    log.warning(
                        "Stream feed of %s could not read the database (%s); retrying in %.1fs",
                        self.task_id,
                        exc,
                        backoff,
                    )
                    self._need_read = True
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX_SECONDS)
                    continue
            if self.ends_at(self.last) and self.ready:
                await self._wake.wait()  # nothing more can come; only a reconnect wakes it
            else:
                # With Redis, messages (and the process's ``feed_watch``) wake the
                # feed; without, it polls.
                interval = None if hub.healthy else settings.LMSP_STREAM_POLL_SECONDS
                for_position = self.task_queued and self.queue_position is None
                if for_position:  # read it when due
                    loop = asyncio.get_running_loop()
                    due = max(0.0, self._position_due - loop.time())
                    interval = due if interval is None else min(interval, due)
                try:
                    async with asyncio.timeout(interval):
                        await self._wake.wait()
                except TimeoutError:
                    # the poll without Redis, or the queue position's read,
                    # unless events said meanwhile that the task runs
                    self._need_read = not for_position or self.task_queued
            self._wake.clear()

    def watched(self) -> bool:
        """Whether the process's periodic check (``feed_watch``) looks at this
        feed: read once, and its task not yet known to have ended."""
        return self.ready and not self.closed and not self.ends_at(self.last)

    def behind(self, position: event_reader.TaskPosition | None) -> bool:
        """Whether the task, where ``feed_watch`` found it (None: gone), has moved
        on from what this feed knows: events or an end it was not told of,
        events removed, or a place in the queue lower than the one it
        reports."""
        if position is None:
            return True
        queued = position.status == Status.QUEUED
        return (
            position.last_event_id > self.last
            or position.pruned_through > self.pruned_through
            or (position.status in FINAL_STATUSES) != self.task_final
            or queued != self.task_queued
            or (
                queued
                and position.queue_rank is not None
                and self.queue_position is not None
                and position.queue_rank < self.queue_position
            )
        )

    async def _refresh(self) -> None:
        """One shared read: the task's position, then whatever events this feed lacks."""
        position = await event_reader.position(self.task_id)
        if position is None:
            self.gone = True
            self.ready = True
            self._pending.clear()
            self._notify()
            return
        # Known final only once the events read with this position are in:
        # set before a read's await, a follower woken meanwhile (a keep-alive)
        # would end at the last event it has, short of the final one.
        final = position.status in FINAL_STATUSES
        self.task_queued = position.status == Status.QUEUED
        if self.task_queued and asyncio.get_running_loop().time() >= self._position_due:
            # one more read, shared by the task's followers
            self.queue_position = await db_call(fairness.queue_position_of, self.task_id)
        self.pruned_through = position.pruned_through
        window = position.last_event_id if self.whole else settings.LMSP_STREAM_WINDOW_EVENTS
        if not self.ready:
            start = max(position.pruned_through, position.last_event_id - window, 0)
            rows = await self._read(start, position.last_event_id)
            self._restart_window(start)
            for event in rows:
                self._append(event.id, event.event, event.data)
            self.ready = True
            pending, self._pending = self._pending, []
            for batch in pending:
                self._apply(batch)
            self.task_final = final
            self._notify()
            return
        if position.pruned_through > self.last:
            # Removed before this feed got them: followers still before them end.
            self._restart_window(position.pruned_through)
            self.task_final = final
            self._notify()
            return
        if position.last_event_id > self.last:
            start = max(self.last, position.last_event_id - window)
            if start > self.last:  # far behind (Redis was down): keep only the window
                self._restart_window(start)
            rows = await self._read(start, position.last_event_id)
            self._apply([(e.id, e.event, e.data) for e in rows])
        self.task_final = final
        self._notify()  # the task may have become final without a new event here

    async def _read(self, after: int, through: int) -> list[StoredEvent]:
        if through <= after:
            return []
        rows = await event_reader.read_range(self.task_id, after, through)
        if not rows or rows[0].id != after + 1:
            raise _Vanished
        return rows


_feeds: dict[str, TaskFeed] = {}


# The process's safety check of its feeds (``feed_watch``).
_watch = FeedWatch(_feeds)


def _on_hub_change() -> None:
    """Redis came back (messages were lost meanwhile) or went away (start polling)."""
    for feed in _feeds.values():
        feed.request_read()
    stream_access.check_soon()  # revocations may have been lost too


hub.on_reconnect = _on_hub_change


def acquire(task_id: str, known: Sequence[StoredEvent] = (), whole: bool = False) -> TaskFeed:
    feed = _feeds.get(task_id)
    if feed is None or feed.closed:
        feed = TaskFeed(task_id)
        _feeds[task_id] = feed
        hub.listen(task_id, feed.on_message)  # before the feed's first read
        feed.seed(known)
        _watch.start()
    feed.whole = feed.whole or whole
    feed.followers += 1
    return feed


def release(feed: TaskFeed) -> None:
    feed.followers -= 1
    if feed.followers == 0:
        feed.close()
        if _feeds.get(feed.task_id) is feed:
            del _feeds[feed.task_id]
            hub.unlisten(feed.task_id)
