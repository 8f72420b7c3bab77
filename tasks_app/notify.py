"""Waking stream readers through Redis pub/sub.

Writers publish each committed batch of events on one channel, the batches
of the tasks a worker flushes together in one message; every web process
keeps a single subscription (``EventHub``) and hands each batch to the one
feed of that task in the process (``tasks_app.streams``). Redis only
carries copies: PostgreSQL is the record, so a lost message costs a feed one
database read, never an event. The same subscription hears the revocations
of ``accounts_app.revocation``, which end open streams
(``tasks_app.stream_access``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings

from accounts_app import revocation
from lmsp_core.redis_client import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

CHANNEL = "lmsp:events"
# Task ids whose cancel was committed: the worker running one drops it from
# its batch at once (``workers.cancellation``), not at its next flush.
CANCEL_CHANNEL = "lmsp:cancel"

# A published batch as a listener reads it back from JSON:
# ``[[id, event, data], ...]`` (``publish``).
Batch = list[list[Any]]


def publish(batches: Mapping[str, Iterable[tuple[int, str, str]]]) -> None:
    """Announce committed events, by task id, in one message: a worker's
    flush of 8 streams wakes each web process once, not 8 times (on a
    machine whose cores an engine's threads hold, every wake-up delays its
    step). A Redis outage is logged, never raised."""
    message = json.dumps({"tasks": {task_id: list(events) for task_id, events in batches.items()}})
    try:
        redis_client().publish(CHANNEL, message)
    except REDIS_ERRORS as exc:
        # The events are committed; readers find them in PostgreSQL.
        log.warning("Could not publish events of %s: %s", ", ".join(batches), exc)


def publish_changed(task_id: str) -> None:
    """Tell the task's feeds to read it again: it changed in a way its events
    do not say (it was deleted, and its streams are to end)."""
    publish({task_id: []})


def publish_cancel(task_id: str) -> None:
    """Announce a committed cancel of a running task; a Redis outage is
    logged, never raised (the worker reads the flag at its next flush)."""
    try:
        redis_client().publish(CANCEL_CHANNEL, task_id)
    except REDIS_ERRORS as exc:
        log.warning("Could not announce the cancel of %s: %s", task_id, exc)


class EventHub:
    """One Redis subscription per process, handed to one listener per task.

    The listeners are the per-task feeds of ``tasks_app.streams``; however
    many streams follow a task, the hub calls one function per message.
    ``healthy`` says whether the subscription is up: while it is not, feeds
    read the database on their own, and when it comes back every feed reads
    once, since messages published meanwhile are lost.
    """

    def __init__(self) -> None:
        self._listeners: dict[str, Callable[[Batch], None]] = {}
        self._listener: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.healthy = False
        self.on_reconnect: Callable[[], None] | None = None
        # Revocations: {"tokens": [ids], "owners": [ids]} (accounts_app.revocation).
        self.on_revocation: Callable[[dict[str, Any]], None] | None = None

    def listen(self, task_id: str, callback: Callable[[Batch], None]) -> None:
        """Hand ``task_id``'s published batches to ``callback`` (replacing any other)."""
        loop = asyncio.get_running_loop()
        if self._listener is None or self._listener.done() or self._loop is not loop:
            self._loop = loop
            self.healthy = False
            self._listener = loop.create_task(self._listen(), name="lmsp-event-hub")
        self._listeners[task_id] = callback

    def unlisten(self, task_id: str) -> None:
        self._listeners.pop(task_id, None)

    def _set_healthy(self, healthy: bool) -> None:
        changed = healthy != self.healthy
        self.healthy = healthy
        if changed and self.on_reconnect is not None:
            self.on_reconnect()  # up: catch up on lost messages; down: start polling

    async def _listen(self) -> None:
        backoff = 0.2
        while True:
            try:
                client = aioredis.Redis.from_url(settings.REDIS_URL)
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL, revocation.CHANNEL)
                    self._set_healthy(True)
                    backoff = 0.2
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._dispatch(message["channel"], message["data"])
            except asyncio.CancelledError:
                self.healthy = False
                raise
            except Exception as exc:  # Redis down or restarted: feeds poll meanwhile
                self._set_healthy(False)
                log.warning("Event hub lost Redis (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _dispatch(self, channel: bytes, raw: bytes) -> None:
        try:
            message = json.loads(raw)
            if channel == revocation.CHANNEL.encode():
                if self.on_revocation is not None:
                    self.on_revocation(message)
                return
            for task_id, events in message["tasks"].items():
                callback = self._listeners.get(task_id)
                if callback is not None:
                    callback(events)
        except Exception:  # a malformed message must not stop the subscription
            log.exception("Could not dispatch an event message")


hub = EventHub()
