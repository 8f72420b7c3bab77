"""A cancel reaches a running generation at once, not at its next flush.

A cancel is a flag on the task (``tasks_app.lifecycle.request_cancel``),
which a run reads at each flush, and flushes are
``LMSP_FLUSH_INTERVAL_SECONDS`` apart: several decoding steps on a fast
device, or with an interval long enough to keep the flushes' CPU away from
decoding. The contract wants generation stopped within one decoding step, so
the cancel is also published after its commit (``notify.CANCEL_CHANNEL``),
and one thread per worker process, subscribed to it, hands it to the run of
that task here, which takes its row out of the batch before the next step.
Redis only carries the wake-up: while it is away, the flush still reads the
flag.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from lmsp_core.redis_client import REDIS_ERRORS, redis_client
from tasks_app.notify import CANCEL_CHANNEL

log = logging.getLogger(__name__)


class CancelWatch:
    """Calls the callback of a task running in this process when its cancel
    is announced."""

    def __init__(self) -> None:
        self._callbacks: dict[str, Callable[[], None]] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @contextmanager
    def watching(self, task_id: str, on_cancel: Callable[[], None]) -> Iterator[None]:
        """Call ``on_cancel`` (from the listening thread) if ``task_id`` is
        cancelled while inside."""
        with self._lock:
            self._callbacks[task_id] = on_cancel
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._listen, name="lmsp-cancel", daemon=True
                )
                self._thread.start()
        try:
            yield
        finally:
            with self._lock:
                if self._callbacks.get(task_id) is on_cancel:
                    del self._callbacks[task_id]

    def _listen(self) -> None:
        backoff = 0.2
        while True:
            # Untyped before redis 8.2: ignored there, and not an unused ignore since.
            pubsub = redis_client().pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call,unused-ignore]
            try:
                pubsub.subscribe(CANCEL_CHANNEL)
                backoff = 0.2
                while True:
                    message = pubsub.get_message(timeout=1.0)
                    if message is not None:
                        self._deliver(message["data"].decode())
            except REDIS_ERRORS as exc:
                log.info("Cancel announcements unavailable (%s); flushes read the flag", exc)
            except Exception:  # the thread outlives any one message
                log.exception("Cancel announcement not handled")
            finally:
                pubsub.close()
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def _deliver(self, task_id: str) -> None:
        with self._lock:
            on_cancel = self._callbacks.get(task_id)
        if on_cancel is not None:
            on_cancel()


cancel_watch = CancelWatch()
