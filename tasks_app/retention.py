"""Retention: events go some time after their task ends, tasks later still."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from responses_app.models import Response

from .idempotency import forget_expired
from .models import FINAL_STATUSES, Event, Task, TaskKind


def prune_events(older_than: float | None = None) -> int:
    """Delete the events of tasks that ended more than ``older_than`` seconds ago.

    Each task's events and its ``pruned_through`` change in one transaction,
    so a reader sees either the events or the 410 that replaces them.
    Returns how many events were removed.
    """
    seconds = settings.LMSP_EVENT_RETENTION_SECONDS if older_than is None else older_than
    cutoff = timezone.now() - timedelta(seconds=seconds)
    due = Task.objects.filter(
        status__in=FINAL_STATUSES, completed_at__lte=cutoff, pruned_through__lt=F("last_event_id")
    )
    removed = 0
    for task_id in due.values_list("id", flat=True):
        with transaction.atomic():
            task = Task.objects.select_for_update().get(id=task_id)
            removed += Event.objects.filter(task=task, seq__lte=task.last_event_id).delete()[0]
            task.pruned_through = task.last_event_id
            task.save(update_fields=["pruned_through"])
    prune_tasks()
    discard_abandoned()
    forget_expired()
    return removed


def prune_tasks() -> int:
    """Forget tasks past ``LMSP_TASK_RETENTION_SECONDS``; stored responses stay."""
    cutoff = timezone.now() - timedelta(seconds=settings.LMSP_TASK_RETENTION_SECONDS)
    expired = Task.objects.filter(
        kind=TaskKind.TASK, status__in=FINAL_STATUSES, completed_at__lte=cutoff
    )
    unstored = Response.objects.filter(task__in=expired, store=False)
    count = expired.count()
    unstored.delete()  # cascades to their tasks
    expired.delete()
    return count


def discard_abandoned() -> int:
    """Direct ``store: false`` responses whose client left before delivery
    (a minute after they ended, so an answer being sent is never pulled away)."""
    return Response.objects.filter(
        task__kind=TaskKind.DIRECT,
        task__status__in=FINAL_STATUSES,
        task__completed_at__lt=timezone.now() - timedelta(seconds=60),
        task__idempotencykey__isnull=True,
        store=False,
    ).delete()[0]
