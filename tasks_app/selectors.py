"""Reads of tasks, and of who is using the queues (for the admin)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.contrib.auth.models import User
from django.db.models import Count, Q, QuerySet, Sum
from django.utils import timezone

from lmsp_core.errors import ProblemError
from lmsp_core.ids import is_valid_id
from lmsp_core.status import Status

from . import fairness
from .models import Task, TaskKind, UsageRecord


def owned_task(owner: User, task_id: str) -> Task:
    """One of the owner's tasks; any other id is 404, existing or not (an id
    that cannot be one, NUL included, never reaches the database)."""
    task = None
    if is_valid_id(task_id, "task"):
        task = (
            Task.objects.select_related("response")
            .filter(id=task_id, owner=owner, kind=TaskKind.TASK)
            .first()
        )
    if task is None:
        raise task_not_found(task_id)
    return task


def task_not_found(task_id: str) -> ProblemError:
    shown = task_id if len(task_id) <= 64 else task_id[:64] + "..."
    return ProblemError("task_not_found", f"No task with id {shown!r}.", param="task_id")


def task_page(
    owner: User,
    *,
    limit: int,
    after: str | None,
    status: str | None,  # noqa: ANN001
) -> tuple[list[Task], bool]:
    tasks: QuerySet[Task] = Task.objects.select_related("response").filter(
        owner=owner, kind=TaskKind.TASK
    )
    if status is not None:
        tasks = tasks.filter(status=status)
    if after is not None:
        tasks = tasks.filter(id__lt=after)
    page = list(tasks.order_by("-id")[: limit + 1])
    return page[:limit], len(page) > limit


STATUSES = [choice.value for choice in Status]


@dataclass(frozen=True)
class OwnerQueue:
    """One owner's share of the queues now, and what it was sent recently."""

    owner_id: int
    username: str
    queued: int
    running: int
    output_tokens: int  # delivered since the window's start
    next_position: int | None  # position of the owner's first waiting task, any model


def queue_by_owner(since: datetime) -> list[OwnerQueue]:
    """Owners with work waiting or running, busiest first: their queued and
    running tasks, output tokens since ``since``, and where the first of
    their waiting tasks stands in its model's fair order."""
    live = (
        Task.objects.filter(status__in=[Status.QUEUED, Status.IN_PROGRESS])
        .values("owner_id", "owner__username")
        .annotate(
            queued=Count("id", filter=Q(status=Status.QUEUED)),
            running=Count("id", filter=Q(status=Status.IN_PROGRESS)),
        )
    )
    tokens = dict(
        UsageRecord.objects.filter(
            completed_at__gte=since, owner_id__in=[r["owner_id"] for r in live]
        )
        .values("owner_id")
        .annotate(n=Sum("output_tokens"))
        .values_list("owner_id", "n")
    )
    rows = []
    for row in live:
        first = (
            Task.objects.filter(owner_id=row["owner_id"], status=Status.QUEUED)
            .order_by(*fairness.FAIR_ORDER)
            .first()
        )
        rows.append(
            OwnerQueue(
                owner_id=row["owner_id"],
                username=row["owner__username"],
                queued=row["queued"],
                running=row["running"],
                output_tokens=tokens.get(row["owner_id"]) or 0,
                next_position=fairness.rank(first) if first else None,
            )
        )
    return sorted(rows, key=lambda r: (-(r.queued + r.running), r.username))


@dataclass(frozen=True)
class OwnerUsage:
    """What the user's admin page shows beside the quotas."""

    queued: int
    running: int
    requests: int
    input_tokens: int
    output_tokens: int
    output_tokens_last_minute: int


def owner_usage(owner_id: int, since: datetime) -> OwnerUsage:
    totals = UsageRecord.objects.filter(owner_id=owner_id, created_at__gte=since).aggregate(
        requests=Count("id"), input_tokens=Sum("input_tokens"), output_tokens=Sum("output_tokens")
    )
    minute = UsageRecord.objects.filter(
        owner_id=owner_id, completed_at__gte=timezone.now() - timedelta(seconds=60)
    ).aggregate(n=Sum("output_tokens"))["n"]
    return OwnerUsage(
        queued=Task.objects.filter(owner_id=owner_id, status=Status.QUEUED).count(),
        running=Task.objects.filter(owner_id=owner_id, status=Status.IN_PROGRESS).count(),
        requests=totals["requests"],
        input_tokens=totals["input_tokens"] or 0,
        output_tokens=totals["output_tokens"] or 0,
        output_tokens_last_minute=minute or 0,
    )
