"""Cheap calls that web processes and workers make to count what happens, into
Redis, where the web's ``/metrics`` collector reads them on each scrape.

Workers run on other machines and web processes come and go, so a
per-process Prometheus registry would lose or split the numbers: every
count goes to Redis hashes instead (HINCRBY, one pipeline per call), and
histograms are kept as per-bucket counts. Recording never raises: a Redis
outage costs a few counts, never a request or a generation.

Only redis and Django settings are imported here; workers import this module.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator
from datetime import datetime
from typing import cast

import redis

from lmsp_core.redis_client import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

PREFIX = "lmsp:metrics:"
REQUESTS_KEY = PREFIX + "requests"  # field: endpoint \t method \t status
OUTPUT_TOKENS_KEY = PREFIX + "output_tokens"  # field: model
ENGINE_COUNTS_KEY = PREFIX + "engine"  # field: model \t count name (ENGINE_COUNTS)
# What the workers' engines count (engine.scheduler.SchedulerStats).
ENGINE_COUNTS = ("prompt_tokens_computed", "prefix_hits", "prefix_tokens_reused", "preemptions")
STREAMS_PREFIX = PREFIX + "sse:"  # one counter per web process, with a time to live
JOBS_KEY = "lmsp:jobs:last_success"  # field: job name, value: Unix time
JOBS_SCHEDULED_KEY = "lmsp:jobs:scheduled_since"  # Unix time Celery beat last started
TTFT = "ttft"
INTER_TOKEN = "itl"
# Upper bounds in seconds. Time to first token includes the wait in the queue.
BUCKETS = {
    TTFT: (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0),
    INTER_TOKEN: (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5),
}
# A web process that dies without closing its streams drops out after this.
STREAMS_TTL_SECONDS = 60
PUSH_EVERY_SECONDS = 1.0
FIELD_SEPARATOR = "\t"


def client() -> redis.Redis:
    """This process's Redis client for the numbers (2 s timeouts: never a hang).
    Recording is best effort and never fails the work it counts: its calls
    catch ``REDIS_ERRORS``."""
    return redis_client()


def histogram_key(name: str, model: str) -> str:
    return f"{PREFIX}hist:{name}:{model}"


def bucket_field(upper: float) -> str:
    return repr(float(upper))


def _bucket(name: str, seconds: float) -> str:
    for upper in BUCKETS[name]:
        if seconds <= upper:
            return bucket_field(upper)
    return "+Inf"


class _Pusher:
    """The web process's counts (requests, open streams), sent to Redis by one
    thread of its own: whatever has queued up since its last call, in one
    pipeline. Recording a count only appends to a queue, so it costs the
    event loop no thread hand-off and no Redis call of its own: with a
    Redis call per request in the executor, a burst of stream connections
    spent more CPU on counting them than on serving them
    (``bench/README.md``, bench_fanout.py). A count waits for the one before
    it at most, not for a timer."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._pid: int | None = None
        self._lock = threading.Lock()

    def put(self, kind: str, value: object) -> None:
        if self._pid != os.getpid():  # first use in this process (or a fork of it)
            with self._lock:
                if self._pid != os.getpid():
                    self._pid = os.getpid()
                    threading.Thread(target=self._run, name="lmsp-metrics", daemon=True).start()
        self._queue.put((kind, value))

    def _run(self) -> None:
        open_streams = 0  # this process's, kept here and written whole
        while True:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            open_streams += sum(int(cast(int, value)) for kind, value in batch if kind == "streams")
            try:
                _push_counts(batch, open_streams)
            except Exception:  # the thread must outlive any one batch
                log.exception("%d counts not recorded", len(batch))


def _push_counts(batch: list[tuple[str, object]], open_streams: int) -> None:
    """Requests are added to their counters; the open streams are written
    whole (SET, not INCRBY), so that a Redis restart, which loses the
    counter, cannot leave it off by the streams opened before it."""
    requests: dict[str, int] = {}
    streams_changed = False
    for kind, value in batch:
        if kind == "request":
            field = cast(str, value)
            requests[field] = requests.get(field, 0) + 1
        else:
            streams_changed = True  # opened, closed, or refreshed before it expires
    try:
        pipe = client().pipeline(transaction=False)
        for field, count in requests.items():
            pipe.hincrby(REQUESTS_KEY, field, count)
        if streams_changed:
            pipe.set(_streams_key(), open_streams, ex=STREAMS_TTL_SECONDS)
        pipe.execute()
    except REDIS_ERRORS as exc:
        log.debug("%d counts not recorded: %s", len(batch), exc)


_pusher = _Pusher()


def count_request(endpoint: str, method: str, status: int) -> None:
    """One HTTP request answered by a web process (queued for ``_Pusher``)."""
    _pusher.put("request", FIELD_SEPARATOR.join((endpoint, method, str(status))))


def add_engine_counts(model: str, counts: dict[str, int]) -> None:
    """What a worker's engine for ``model`` counted since its last call."""
    try:
        pipe = client().pipeline(transaction=False)
        for name, count in counts.items():
            if count:
                pipe.hincrby(ENGINE_COUNTS_KEY, FIELD_SEPARATOR.join((model, name)), count)
        pipe.execute()
    except REDIS_ERRORS as exc:
        log.warning("engine counts of %s not recorded: %s", model, exc)


def job_succeeded(job: str) -> None:
    """A periodic job (the sweeper, the pruner) ran to its end just now."""
    try:
        client().hset(JOBS_KEY, job, repr(time.time()))
    except REDIS_ERRORS as exc:
        log.warning("last run of %s not recorded: %s", job, exc)


def jobs_scheduled() -> None:
    """Celery beat started just now: a job that has never run is due an
    interval from here, and is not late before."""
    try:
        client().set(JOBS_SCHEDULED_KEY, repr(time.time()))
    except REDIS_ERRORS as exc:
        log.warning("the start of the periodic jobs not recorded: %s", exc)


class TokenTimer:
    """Counts a generation's tokens and times them: the first token from the
    request's arrival, the others from the token before. Pushed to Redis about
    once a second, when the generation stops, and when the timer is dropped."""

    def __init__(self, model: str, requested_at: datetime | None) -> None:
        self.model = model
        # None: this run continues an answer begun by an earlier attempt.
        self.requested_at = requested_at.timestamp() if requested_at else None
        self.last: float | None = None
        self.pushed = time.monotonic()
        self.pending: dict[str, dict[str, float]] = {TTFT: {}, INTER_TOKEN: {}, "tokens": {}}
        self._finalizer = weakref.finalize(self, _push, model, self.pending)

    def tick(self, now: float) -> None:
        """A token made at ``now`` (``time.time()``: a reader may take several at once)."""
        if self.last is None:
            if self.requested_at is not None:
                self._observe(TTFT, max(now - self.requested_at, 0.0))
        else:
            self._observe(INTER_TOKEN, now - self.last)
        self.last = now
        tokens = self.pending["tokens"]
        tokens["n"] = tokens.get("n", 0) + 1
        if time.monotonic() - self.pushed >= PUSH_EVERY_SECONDS:
            self.push()

    def _observe(self, name: str, seconds: float) -> None:
        counts = self.pending[name]
        field = _bucket(name, seconds)
        counts[field] = counts.get(field, 0) + 1
        counts["sum"] = counts.get("sum", 0.0) + seconds
        counts["count"] = counts.get("count", 0) + 1

    def push(self) -> None:
        _push(self.model, self.pending)
        self.pushed = time.monotonic()


def _push(model: str, pending: dict[str, dict[str, float]]) -> None:
    if not any(pending.values()):
        return
    snapshot = {name: dict(values) for name, values in pending.items()}
    for values in pending.values():
        values.clear()
    try:
        pipe = client().pipeline(transaction=False)
        for name in (TTFT, INTER_TOKEN):
            key = histogram_key(name, model)
            for field, value in snapshot[name].items():
                if field == "sum":
                    pipe.hincrbyfloat(key, field, value)
                else:
                    pipe.hincrby(key, field, int(value))
        if snapshot["tokens"]:
            pipe.hincrby(OUTPUT_TOKENS_KEY, model, int(snapshot["tokens"]["n"]))
        pipe.execute()
    except REDIS_ERRORS as exc:
        log.warning("token metrics of %s not recorded: %s", model, exc)


def _streams_key() -> str:
    return f"{STREAMS_PREFIX}{socket.gethostname()}:{os.getpid()}"


async def counted_stream(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE body, counted as an open stream from its first chunk to its end
    (client gone included). The counts go to Redis from ``_Pusher``'s thread:
    the stream's own work (the first event, cancelling an abandoned
    generation) never waits on it."""
    _pusher.put("streams", 1)
    touched = time.monotonic()
    try:
        async for chunk in chunks:
            yield chunk
            if time.monotonic() - touched > STREAMS_TTL_SECONDS / 3:
                touched = time.monotonic()
                _pusher.put("touch", None)
    finally:
        try:
            close = getattr(chunks, "aclose", None)
            if close is not None:  # the wrapped body ends now, not when collected
                await close()
        finally:
            _pusher.put("streams", -1)
