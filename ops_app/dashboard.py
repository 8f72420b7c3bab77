"""What the admin's dashboard and model pages show, read from the database,
the registry and the workers' heartbeats.

Request counts come from the usage records, which outlive the responses
(a direct ``store: false`` response is deleted once delivered).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import redis
from django.db.models import Count, Q, Sum
from django.db.models.functions import TruncHour
from django.utils import timezone

from generation.registry import ModelSpec, available_models, declared_models
from lmsp_core.status import Status
from tasks_app import heartbeat
from tasks_app.models import Task, UsageRecord

WINDOW = timedelta(hours=24)


@dataclass(frozen=True)
class ModelUsage:
    model: str
    requests: int
    input_tokens: int
    output_tokens: int
    failed: int


@dataclass(frozen=True)
class Hourly:
    hours: list[datetime]  # the start of each of the last 24 hours, oldest first
    requests: dict[str, list[int]]  # per model
    failures: list[int]


@dataclass(frozen=True)
class ModelRow:
    spec: ModelSpec
    available: bool  # the weights are on this (the web) machine
    workers: list[heartbeat.Beat] | None  # None: Redis could not be asked


def usage_by_model(since: datetime) -> list[ModelUsage]:
    rows = (
        UsageRecord.objects.filter(created_at__gte=since)
        .values("model")
        .annotate(
            requests=Count("id"),
            input_tokens=Sum("input_tokens"),
            output_tokens=Sum("output_tokens"),
            failed=Count("id", filter=Q(status=Status.FAILED)),
        )
        .order_by("model")
    )
    return [ModelUsage(**row) for row in rows]


def hourly(now: datetime) -> Hourly:
    last = now.replace(minute=0, second=0, microsecond=0)
    hours = [last - timedelta(hours=n) for n in range(23, -1, -1)]
    index = {hour: i for i, hour in enumerate(hours)}
    rows = (
        UsageRecord.objects.filter(created_at__gte=hours[0])
        .annotate(hour=TruncHour("created_at"))
        .values("model", "hour")
        .annotate(n=Count("id"), failed=Count("id", filter=Q(status=Status.FAILED)))
    )
    requests: dict[str, list[int]] = {}
    failures = [0] * len(hours)
    for row in rows:
        i = index.get(row["hour"])
        if i is None:
            continue
        requests.setdefault(row["model"], [0] * len(hours))[i] += row["n"]
        failures[i] += row["failed"]
    return Hourly(hours, dict(sorted(requests.items())), failures)


def queue_depth() -> dict[str, dict[str, int]]:
    """Per model: tasks waiting for a worker and tasks being generated now."""
    depth = {model_id: {"queued": 0, "in_progress": 0} for model_id in available_models()}
    rows = (
        Task.objects.filter(status__in=[Status.QUEUED, Status.IN_PROGRESS])
        .values("model", "status")
        .annotate(n=Count("id"))
    )
    for row in rows:
        depth.setdefault(row["model"], {"queued": 0, "in_progress": 0})[row["status"]] = row["n"]
    return dict(sorted(depth.items()))


def recent_failures(since: datetime, limit: int = 20) -> list[Task]:
    return list(
        Task.objects.filter(status=Status.FAILED, completed_at__gte=since)
        .select_related("owner")
        .order_by("-completed_at")[:limit]
    )


def model_rows() -> list[ModelRow]:
    """Every declared model, whether its weights are here, and who serves it."""
    try:
        served: dict[str, list[heartbeat.Beat]] | None = heartbeat.serving_workers()
    except redis.RedisError:
        served = None
    available = available_models()
    return [
        ModelRow(
            spec=spec,
            available=model_id in available,
            workers=None if served is None else served.get(model_id, []),
        )
        for model_id, spec in declared_models().items()
    ]


def since_window(now: datetime | None = None) -> tuple[datetime, datetime]:
    now = now or timezone.now()
    return now, now - WINDOW
