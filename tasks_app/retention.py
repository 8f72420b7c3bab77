"""Retention of task history: events go some time after their task ends, tasks
later still. ``responses_app.retention.prune_history`` runs these in order,
with the responses nobody needs any more."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from lmsp_core.status import FINAL_STATUSES

from .models import Event, Task, TaskKind


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
    return removed


def forget_expired_tasks() -> int:
    """Forget tasks past ``LMSP_TASK_RETENTION_SECONDS``; their stored responses stay."""
    cutoff = timezone.now() - timedelta(seconds=settings.LMSP_TASK_RETENTION_SECONDS)
    expired = Task.objects.filter(
        kind=TaskKind.TASK, status__in=FINAL_STATUSES, completed_at__lte=cutoff
    )
    return expired.delete()[0]
