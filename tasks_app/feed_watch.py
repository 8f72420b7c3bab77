"""The per-process safety check of the event feeds (``feeds``).

A feed learns of its task's events from Redis messages; a message can be
lost (a final one included) without Redis going away, and an idle feed
makes no query of its own. So, while a process has feeds and Redis is up,
one check every ``LMSP_STREAM_CHECK_SECONDS`` reads, in one query, where
the tasks of all of them stand (``event_reader.positions``), and only the
feeds whose task moved on without their knowing read it again. Without
Redis the feeds poll on their own (``LMSP_STREAM_POLL_SECONDS``).

Kept apart from the feeds so that one feed's life (``feeds.TaskFeed``)
reads apart from the one check that looks at all of them; it knows them
only by what it asks of them (``Watched``) and the registry it is given.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Protocol

from django.conf import settings

from . import event_reader
from .event_reader import READ_ERRORS
from .notify import hub

log = logging.getLogger(__name__)


class Watched(Protocol):
    """What the check asks of a feed (``feeds.TaskFeed``)."""

    task_id: str

    def watched(self) -> bool: ...

    def behind(self, position: event_reader.TaskPosition | None) -> bool: ...

    def request_read(self) -> None: ...


class FeedWatch:
    """The check of the feeds of ``feeds`` (a registry by task id), run on
    the event loop of the feeds while the registry holds any."""

    def __init__(self, feeds: Mapping[str, Watched]) -> None:
        self.feeds = feeds
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Run the check on this event loop, unless it runs there already."""
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.task = loop.create_task(self._run(), name="lmsp-stream-watch")

    async def _run(self) -> None:
        while self.feeds:
            await asyncio.sleep(settings.LMSP_STREAM_CHECK_SECONDS)
            watched = [feed for feed in self.feeds.values() if feed.watched()]
            if not hub.healthy or not watched:
                continue
            try:
                found = await event_reader.positions([feed.task_id for feed in watched])
            except READ_ERRORS as exc:  # the next check tries again
                log.warning("Could not check the tasks of open streams (%s)", exc)
                continue
            for feed in watched:
                if feed.behind(found.get(feed.task_id)):
                    feed.request_read()
