"""Which workers serve which model: for the admin's model page and
``/metrics`` (``ops_app``), and for sending a conversation's next turn to the
worker that holds it (``routing``).

A model worker writes one Redis key per model it serves, every
``INTERVAL_SECONDS``, with a time to live of a few intervals: a worker that
dies stops renewing its keys and drops out of the listing on its own, with
no shutdown hook needed (a clean shutdown removes them at once anyway).
A beat also carries what the worker's engine for the model holds now
(``engine``: its token budget, the tokens in use, the prefix cache's size),
which ``/metrics`` adds up over the live workers.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis

from lmsp_core.redis_client import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

KEY_PREFIX = "lmsp:heartbeat:"
INTERVAL_SECONDS = 5.0
# Long enough to ride out one slow write, short enough that a dead worker
# disappears from the model page within a quarter of a minute.
TTL_SECONDS = 15


@dataclass(frozen=True)
class Beat:
    model: str
    worker: str
    at: float  # Unix time of the last beat
    engine: dict[str, int] = field(default_factory=dict)


def _key(model_id: str, worker: str) -> str:
    return f"{KEY_PREFIX}{worker}|{model_id}"


EngineReport = Callable[[str], dict[str, int]]


def beat(model_ids: Iterable[str], worker: str, report: EngineReport | None = None) -> None:
    """Say once that ``worker`` serves these models, for the next ``TTL_SECONDS``
    (with ``report(model_id)``, what its engine holds)."""
    now = time.time()
    pipe = redis_client().pipeline(transaction=False)
    for model_id in model_ids:
        engine = report(model_id) if report is not None else {}
        value = json.dumps({"model": model_id, "worker": worker, "at": now, "engine": engine})
        pipe.set(_key(model_id, worker), value, ex=TTL_SECONDS)
    pipe.execute()


def forget(model_ids: Iterable[str], worker: str) -> None:
    keys = [_key(model_id, worker) for model_id in model_ids]
    if keys:
        redis_client().delete(*keys)


def _parsed(raw: bytes | str) -> Beat:
    data = json.loads(raw)
    return Beat(data["model"], data["worker"], data["at"], data.get("engine", {}))


def beat_of(model_id: str, worker: str) -> Beat | None:
    """The live beat of one worker for one model (None: not serving it)."""
    raw = redis_client().get(_key(model_id, worker))
    return _parsed(raw) if raw is not None else None


def serving_workers() -> dict[str, list[Beat]]:
    """Live beats by model id. Raises ``redis.RedisError`` when Redis is down,
    so that the caller can say "unknown" rather than "not served"."""
    client = redis_client()
    keys = list(client.scan_iter(match=f"{KEY_PREFIX}*", count=500))
    served: dict[str, list[Beat]] = defaultdict(list)
    for raw in client.mget(keys) if keys else []:
        if raw is None:  # expired between SCAN and MGET
            continue
        found = _parsed(raw)
        served[found.model].append(found)
    return dict(served)


def served_elsewhere(model_ids: Iterable[str], worker: str) -> bool:
    """Whether another worker than ``worker`` beats for each of ``model_ids``
    (a draining worker's successor is up); False when Redis cannot say."""
    try:
        served = serving_workers()
    except REDIS_ERRORS:  # the drain thread must go on to its deadline
        return False
    return all(
        any(found.worker != worker for found in served.get(model_id, [])) for model_id in model_ids
    )


class Heartbeat:
    """A daemon thread beating for one worker until ``stop``."""

    def __init__(
        self, model_ids: list[str], worker: str, report: EngineReport | None = None
    ) -> None:
        self.model_ids = model_ids
        self.worker = worker
        self.report = report
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lmsp-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=INTERVAL_SECONDS)
        try:
            forget(self.model_ids, self.worker)
        except redis.RedisError as exc:
            log.warning("Could not remove heartbeat keys (they expire anyway): %s", exc)

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                beat(self.model_ids, self.worker, self.report)
            except redis.RedisError as exc:
                # A broker outage must not kill the thread: beating resumes with Redis.
                log.warning("Heartbeat of %s failed: %s", self.worker, exc)
            self._stopped.wait(INTERVAL_SECONDS)
