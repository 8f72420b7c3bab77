"""Waking stream readers through Redis pub/sub.

Writers publish each committed batch of events on one channel; every web
process keeps a single subscription (``EventHub``) and hands batches to the
readers of that task in the process. Redis only wakes readers: PostgreSQL is
the record, so a lost message costs a reader one extra database read, never
an event (see ``tasks_app.streams``).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import defaultdict
from collections.abc import Iterable

import redis
import redis.asyncio as aioredis
from django.conf import settings

from lmsp_project.redis_client import redis_client

log = logging.getLogger(__name__)

CHANNEL = "lmsp:events"


def publish(task_id: str, events: Iterable[tuple[int, str, str]]) -> None:
    """Announce committed events; a Redis outage is logged, never raised."""
    message = json.dumps({"task": task_id, "events": list(events)})
    try:
        redis_client().publish(CHANNEL, message)
    except redis.RedisError as exc:
        log.warning("Could not publish events of %s: %s", task_id, exc)


class EventHub:
    """One Redis subscription per process, fanned out to per-task queues."""

    def __init__(self) -> None:
        self._queues: dict[str, set[asyncio.Queue]] = defaultdict(set)
        self._listener: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def subscribe(self, task_id: str) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        if self._listener is None or self._listener.done() or self._loop is not loop:
            self._loop = loop
            self._listener = loop.create_task(self._listen(), name="lmsp-event-hub")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[task_id].add(queue)
        return queue

    def unsubscribe(self, task_id: str, queue: asyncio.Queue) -> None:
        queues = self._queues.get(task_id)
        if queues is not None:
            queues.discard(queue)
            if not queues:
                del self._queues[task_id]

    async def _listen(self) -> None:
        backoff = 0.2
        while True:
            try:
                client = aioredis.Redis.from_url(settings.REDIS_URL)
                async with client.pubsub() as pubsub:
                    await pubsub.subscribe(CHANNEL)
                    backoff = 0.2
                    async for message in pubsub.listen():
                        if message.get("type") == "message":
                            self._dispatch(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis down or restarted: readers poll meanwhile
                log.warning("Event hub lost Redis (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)

    def _dispatch(self, raw: bytes) -> None:
        try:
            message = json.loads(raw)
        except ValueError:
            return
        for queue in self._queues.get(message.get("task"), ()):
            queue.put_nowait(message["events"])


hub = EventHub()
