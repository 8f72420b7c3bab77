"""Erased words leave this worker's prefix caches too (issue "Security III").

Once an erasure commits, the web names the owners whose text went away on
Redis (``lmsp_core.erasure_news``). One thread per model worker, subscribed
from its start, hands each message to every engine of the process
(``BatchingEngine.forget``); the engine thread drops the entries itself,
between two steps, so the cache is never changed under a step. Redis only
carries the news: when the subscription comes back after losing Redis
(messages may have been lost meanwhile), every entry goes.
"""

from __future__ import annotations

import logging
import threading
import time

from engine.client import engines
from lmsp_core import erasure_news
from lmsp_core.redis_client import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

_started = threading.Lock()
_thread: threading.Thread | None = None


def listen() -> None:
    """Start this process's subscription (once; a no-op after)."""
    global _thread
    with _started:
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_listen, name="lmsp-erasure", daemon=True)
            _thread.start()


def forget(owners: list[int] | None) -> None:
    """Hand an erasure to every engine of this process (None: of anyone)."""
    if owners is None or owners:
        for engine in engines():
            engine.forget(owners)


def _listen() -> None:
    backoff, lost = 0.2, False
    while True:
        # Untyped before redis 8.2: ignored there, and not an unused ignore since.
        pubsub = redis_client().pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
        try:
            pubsub.subscribe(erasure_news.CHANNEL)
            if lost:  # erasures may have been announced meanwhile
                forget(None)
            backoff, lost = 0.2, False
            while True:
                message = pubsub.get_message(timeout=1.0)
                if message is not None:
                    forget(erasure_news.parse(message["data"]))
        except REDIS_ERRORS as exc:
            log.warning(
                "Erasure news unavailable (%s); every cached prefix goes at its return", exc
            )
        except Exception:  # the thread outlives any one message
            log.exception("Erasure news not handled")
        finally:
            pubsub.close()
        lost = True  # the loop above ends only when the subscription breaks
        time.sleep(backoff)
        backoff = min(backoff * 2, 5.0)
