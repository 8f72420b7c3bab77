"""Health of the periodic jobs Celery beat runs: when the sweeper (lost and
expired tasks) and the pruner (retention) last ran to their end, and whether
that is too long ago (beat or the ops worker is down, or the job keeps failing).

The workers record each success in Redis (``recorders.job_succeeded``), and
beat its own start (``recorders.jobs_scheduled``); the admin's dashboard and
``/metrics`` read them here. A job that has never run is stale only once its
first run is overdue as much as a later one would be (counted from beat's
start), not right after a start; with no start recorded either, beat has
never run here, and every job is stale.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from django.conf import settings

from . import recorders

SWEEP = "sweep_tasks"
PRUNE = "prune_events"
# Missing this many runs in a row, plus a margin for a slow one, is stale.
STALE_AFTER_RUNS = 3
STALE_MARGIN_SECONDS = 30.0


@dataclass(frozen=True)
class JobHealth:
    job: str
    interval: float  # seconds between runs
    last_success: float | None  # Unix time; None: never (since Redis was emptied)
    age: float | None  # seconds since then
    stale: bool


def intervals() -> dict[str, float]:
    return {
        SWEEP: float(settings.LMSP_SWEEP_INTERVAL_SECONDS),
        PRUNE: float(settings.LMSP_PRUNE_INTERVAL_SECONDS),
    }


def stale_after(interval: float) -> float:
    return STALE_AFTER_RUNS * interval + STALE_MARGIN_SECONDS


def job_health(now: float | None = None) -> list[JobHealth]:
    """Every periodic job's last success. Raises ``redis.RedisError`` when Redis
    cannot be asked (the caller says "unknown", not "stale")."""
    now = time.time() if now is None else now
    client = recorders.client()
    raw = client.hgetall(recorders.JOBS_KEY)
    recorded = {
        key.decode() if isinstance(key, bytes) else key: float(value) for key, value in raw.items()
    }
    scheduled = client.get(recorders.JOBS_SCHEDULED_KEY)
    health = []
    for job, interval in intervals().items():
        last = recorded.get(job)
        age = None if last is None else max(now - last, 0.0)
        if last is not None:
            waited = age
        elif scheduled is not None:  # never run: its first run is due an interval after this
            waited = now - float(scheduled)
        else:  # nor beat ever started
            waited = None
        stale = waited is None or waited > stale_after(interval)
        health.append(JobHealth(job, interval, last, age, stale))
    return health


def job_health_or_none() -> list[JobHealth] | None:
    try:
        return job_health()
    except redis.RedisError:
        return None
