"""The sweeper, run periodically: it hands on tasks whose worker stopped
renewing its lease, and re-sends the jobs of queued tasks whose broker
message was lost (``tasks_app.broker``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from generation.registry import declared_models
from lmsp_core.errors import problem
from lmsp_core.status import Status

from . import broker, endings, jobs
from .models import Task

log = logging.getLogger(__name__)


@dataclass
class SweepReport:
    requeued: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # failed (worker_lost) or cancelled
    resent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # their model is no longer declared
    errors: list[str] = field(default_factory=list)  # raised while swept; tried again next time


def _sweep_expired(task_id: str, now: datetime, report: SweepReport) -> None:
    with transaction.atomic():
        task = Task.objects.select_for_update().select_related("response").get(id=task_id)
        lease = task.lease_expires_at
        if task.status != Status.IN_PROGRESS or lease is None or lease >= now:
            return
        if task.cancel_requested:
            endings.finalize(task, *endings.partial_outcome(task, Status.CANCELLED))
            report.ended.append(task.id)
        elif task.attempt - task.handed_back >= settings.LMSP_MAX_ATTEMPTS:
            error = problem(
                "worker_lost",
                f"The worker running this task was lost {task.attempt - task.handed_back} "
                "times; giving up.",
            )
            endings.finalize(task, *endings.partial_outcome(task, Status.FAILED, error))
            report.ended.append(task.id)
        elif (queue := jobs.queue_of(task)) is None:
            endings.fail_model_gone(task)
            report.failed.append(task.id)
        else:
            log.warning("Lease of %s (attempt %s) expired; re-queueing", task.id, task.attempt)
            jobs.queue_again(task, queue, now)
            report.requeued.append(task.id)


def _resend(task_id: str, now: datetime, report: SweepReport) -> None:
    """Send a still queued task's job again (its message is gone), or fail it
    when its model is."""
    with transaction.atomic():
        task = Task.objects.select_for_update().select_related("response").get(id=task_id)
        if task.status != Status.QUEUED:
            return
        queue = jobs.queue_of(task)
        if queue is None:
            endings.fail_model_gone(task)
            report.failed.append(task.id)
            return
        task.enqueued_at = now  # sent now: the next look is a full period away
        task.save(update_fields=["enqueued_at"])
    jobs.send_job(task.id, task.model, queue)
    report.resent.append(task.id)


def sweep() -> SweepReport:
    """Hand on tasks whose worker stopped renewing its lease; re-send the jobs
    of queued tasks whose broker message is gone.

    Each task is swept on its own: one that raises is logged and left for the
    next sweep, and the others go on. A task whose model was removed from the
    registry fails with ``generation_failed`` (``model_gone_problem``).
    """
    report = SweepReport()
    now = timezone.now()
    expired = Task.objects.filter(status=Status.IN_PROGRESS, lease_expires_at__lt=now)
    for task_id in expired.values_list("id", flat=True):
        try:
            _sweep_expired(task_id, now, report)
        except Exception:
            log.exception("Sweeping the expired lease of %s failed", task_id)
            report.errors.append(task_id)
    stale = now - timedelta(seconds=settings.LMSP_REQUEUE_AFTER_SECONDS)
    waiting = list(
        Task.objects.filter(status=Status.QUEUED, enqueued_at__lt=stale).values_list("id", "model")
    )
    if not waiting:
        return report
    queues = {spec.queue for spec in declared_models().values()}
    in_broker = broker.task_ids_in_broker(queues, taken_since=stale.timestamp())
    declared = declared_models()
    if in_broker is None:  # the broker cannot be read: nothing is known lost, nor sendable
        waiting = [(task_id, model) for task_id, model in waiting if model not in declared]
    else:  # waiting their turn behind a backlog: looked at now, again a period later
        behind = [task_id for task_id, model in waiting if task_id in in_broker]
        Task.objects.filter(id__in=behind, status=Status.QUEUED).update(enqueued_at=now)
        waiting = [(task_id, model) for task_id, model in waiting if task_id not in in_broker]
    for task_id, _ in waiting:
        try:
            _resend(task_id, now, report)
        except Exception:
            log.exception("Sweeping the queued task %s failed", task_id)
            report.errors.append(task_id)
    return report
