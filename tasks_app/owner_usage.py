"""Each owner's use of each model as ``/metrics`` shows it
(``ops_app.collector``): the requests that ended, from the ``DailyUsage``
rows of every day (kept beyond retention, so the counters built on them
never go back), and the requests in flight now. ``by_owner`` false adds the
owners up per model, for deployments with too many owners for one series
each (``LMSP_METRICS_OWNER_LABEL``)."""

from __future__ import annotations

from dataclasses import dataclass

from django.db.models import Count, Sum

from lmsp_core.status import Status

from .models import DailyUsage, Task


@dataclass(frozen=True)
class OwnerUsage:
    owner: str  # the owner's username; "" when added up over owners
    model: str
    requests: int
    input_tokens: int
    output_tokens: int
    cached_tokens: int
    worker_seconds: float


def ended(by_owner: bool) -> list[OwnerUsage]:
    """Totals of the requests that ended, per owner (if ``by_owner``) and model."""
    keys = ["owner__username", "model"] if by_owner else ["model"]
    rows = (
        DailyUsage.objects.values(*keys)
        .annotate(
            n=Sum("requests"),
            input=Sum("input_tokens"),
            output=Sum("output_tokens"),
            cached=Sum("cached_tokens"),
            seconds=Sum("worker_seconds"),
        )
        .order_by(*keys)
    )
    return [
        OwnerUsage(
            row.get("owner__username", ""),
            row["model"],
            row["n"],
            row["input"],
            row["output"],
            row["cached"],
            row["seconds"],
        )
        for row in rows
    ]


def in_flight(by_owner: bool) -> list[tuple[str, str, int]]:
    """(owner or "", model, requests queued or running now)."""
    keys = ["owner__username", "model"] if by_owner else ["model"]
    rows = (
        Task.objects.filter(status__in=[Status.QUEUED, Status.IN_PROGRESS])
        .values(*keys)
        .annotate(n=Count("id"))
        .order_by(*keys)
    )
    return [(row.get("owner__username", ""), row["model"], row["n"]) for row in rows]
