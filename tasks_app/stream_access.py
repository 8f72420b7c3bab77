"""Open streams end when the token that opened them no longer opens anything.

A stream is authorized when it opens and may then last for hours. Each web
process keeps the streams it serves (``StreamAccess``, one per stream: its
token and the token's owner) and ends those of a token that is revoked,
expired or deleted, or whose owner is deactivated or deleted:

- at once, when ``accounts_app.revocation`` says so on Redis (heard by the
  process's one subscription, ``tasks_app.notify``);
- within ``LMSP_STREAM_ACCESS_CHECK_SECONDS`` otherwise (a message lost
  while Redis was down, an expiry coming due, a row changed by hand): one
  query per process reads which of its streams' tokens are still usable,
  however many streams there are; none while the process serves no stream.
  A Redis reconnect (messages may have been lost) checks at once.

An ended stream stops where it is (``tasks_app.streams``): a follower's
stream closes without a final event, and its reconnect is answered ``401``;
a reader of events (a direct stream, the OpenAI routes) gets an ``error``
event with the ``unauthorized`` problem, and a direct generation is then
treated as one whose client left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.conf import settings

from .event_reader import READ_ERRORS, usable_tokens
from .notify import hub

if TYPE_CHECKING:
    from accounts_app.models import ApiToken

log = logging.getLogger(__name__)


class StreamAccess:
    """The token (and its owner) one stream was opened with; ``ended`` once
    that access is taken away. ``wake`` is called then, so that a waiting
    stream notices at once."""

    __slots__ = ("token_id", "owner_id", "ended", "wake")

    def __init__(self, token_id: int, owner_id: int) -> None:
        self.token_id = token_id
        self.owner_id = owner_id
        self.ended = False
        self.wake: Callable[[], None] | None = None

    @classmethod
    def of(cls, token: ApiToken) -> StreamAccess:
        """The access of a stream opened with ``token`` (an ``ApiToken``)."""
        return cls(token.pk, token.owner_id)

    def open(self, wake: Callable[[], None]) -> None:
        """The stream starts: watch its token until ``close``."""
        self.wake = wake
        _open[self] = None
        _checker.start()

    def close(self) -> None:
        _open.pop(self, None)
        self.wake = None

    def end(self) -> None:
        self.ended = True
        if self.wake is not None:
            self.wake()


_open: dict[StreamAccess, None] = {}  # the streams of this process, in opening order


def revoked(message: dict[str, Any]) -> None:
    """A revocation heard on Redis: ``{"tokens": [ids], "owners": [ids]}``."""
    tokens, owners = set(message.get("tokens", ())), set(message.get("owners", ()))
    for access in list(_open):
        if access.token_id in tokens or access.owner_id in owners:
            access.end()


class _Checker:
    """The periodic check of one event loop: runs while streams are open."""

    def __init__(self) -> None:
        self.task: asyncio.Task[None] | None = None
        self.soon: asyncio.Event | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        if self.task is None or self.task.done() or self.task.get_loop() is not loop:
            self.soon = asyncio.Event()
            self.task = loop.create_task(self._run(), name="lmsp-stream-access")

    def check_soon(self) -> None:
        if self.soon is not None and self.task is not None and not self.task.done():
            self.task.get_loop().call_soon_threadsafe(self.soon.set)

    async def _run(self) -> None:
        assert self.soon is not None  # set with the task that runs this
        while _open:
            try:
                async with asyncio.timeout(settings.LMSP_STREAM_ACCESS_CHECK_SECONDS):
                    await self.soon.wait()
            except TimeoutError:
                pass
            self.soon.clear()
            token_ids = sorted({access.token_id for access in _open})
            if not token_ids:
                continue
            try:
                usable = await usable_tokens(token_ids)
            except READ_ERRORS as exc:  # the next check tries again
                log.warning("Could not check the tokens of open streams (%s)", exc)
                continue
            for access in list(_open):
                if access.token_id not in usable:
                    access.end()


_checker = _Checker()


def check_soon() -> None:
    """Check the open streams' tokens now (Redis came back: revocations sent
    meanwhile were lost)."""
    _checker.check_soon()


hub.on_revocation = revoked
