"""Whether each model's upstream server answers: recorded by the workers,
read by ``/readyz``, ``/metrics`` and the admin.

Why in Redis: the worker that serves an upstream model is the one that
reaches its server (the web process may not even have a route to it), so
its probes (``workers.upstream.watch_health``, every
``PROBE_INTERVAL_SECONDS``) and its requests that found the server down
record the outcome here, one hash field per model: reachable or not, since
when (the last change), when last checked, and why not. Recording never
raises; a reading older than ``STALE_AFTER_SECONDS`` means no worker probes
that server now.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from lmsp_core.redis_client import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

KEY = "lmsp:upstreams"  # field: model id, value: an UpstreamHealth as JSON
PROBE_INTERVAL_SECONDS = 10.0
STALE_AFTER_SECONDS = 3 * PROBE_INTERVAL_SECONDS + 5


@dataclass(frozen=True)
class UpstreamHealth:
    model: str
    reachable: bool
    since: float  # Unix time of the last change between reachable and not
    checked_at: float  # Unix time of the last probe or request
    reason: str  # why not reachable ("" when it is)

    def stale(self, now: float) -> bool:
        return now - self.checked_at > STALE_AFTER_SECONDS


def record(model: str, problem: str | None) -> None:
    """A probe or a request found the model's server answering (``problem``
    None) or not, just now."""
    now = time.time()
    try:
        client = redis_client()
        before = _parse(model, client.hget(KEY, model))
        reachable = problem is None
        since = before.since if before is not None and before.reachable == reachable else now
        health = UpstreamHealth(model, reachable, since, now, problem or "")
        client.hset(KEY, model, json.dumps(asdict(health)))
    except REDIS_ERRORS as exc:
        log.warning("the health of %s's upstream server not recorded: %s", model, exc)


def read(models: list[str]) -> dict[str, UpstreamHealth]:
    """The last reading for each of ``models`` that has one. Raises Redis's
    errors (the caller says "unknown")."""
    if not models:
        return {}
    values = redis_client().hmget(KEY, models)
    found = {model: _parse(model, value) for model, value in zip(models, values, strict=True)}
    return {model: health for model, health in found.items() if health is not None}


def _parse(model: str, value: bytes | str | None) -> UpstreamHealth | None:
    if value is None:
        return None
    try:
        fields = json.loads(value)
        return UpstreamHealth(
            model,
            bool(fields["reachable"]),
            float(fields["since"]),
            float(fields["checked_at"]),
            str(fields["reason"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
