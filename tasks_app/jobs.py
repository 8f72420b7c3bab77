"""Queued tasks and their broker messages: sending a task's job once its row
is committed, and putting a running task back in its model's queue.

Every queued task has sent one job (a slot for its model, see
``claims.claim``); whoever queues a task, the submit, a hand-back, the
sweeper or an operator's re-queue, sends it from here.
"""

from __future__ import annotations

import logging
from datetime import datetime

from django.db import transaction

from generation.registry import declared_models
from lmsp_core.celery_app import app as celery_app
from lmsp_core.status import Status

from . import fairness
from .models import Task

log = logging.getLogger(__name__)

RUN_TASK = "workers.tasks.run_task"


def enqueue_on_commit(
    task: Task, queue: str, preferred: bool = False, countdown: float = 0.0
) -> None:
    """Send the job once the task row is committed, so no worker sees it early."""
    enqueue_on_commit_id(task.id, task.model, queue, preferred, countdown)


def enqueue_on_commit_id(
    task_id: str, model: str, queue: str, preferred: bool = False, countdown: float = 0.0
) -> None:
    transaction.on_commit(lambda: send_job(task_id, model, queue, preferred, countdown))


def send_job(
    task_id: str, model: str, queue: str, preferred: bool = False, countdown: float = 0.0
) -> None:
    """The job of a queued task: a slot for its model (see ``claim``), so the
    message names the model too; the task may be gone when it is taken. A
    job sent to one worker's own queue (``preferred``) is that task's first.
    ``countdown``: taken no sooner than that many seconds from now (a task
    waiting for its upstream server, ``upstream_waits``)."""
    try:
        celery_app.send_task(
            RUN_TASK, args=[task_id, model, preferred], queue=queue, countdown=countdown or None
        )
    except Exception as exc:  # broker down: the sweeper sends it again later
        log.warning("Could not enqueue %s (%s); the sweeper will retry", task_id, exc)


def queue_of(task: Task) -> str | None:
    """The queue of the task's model; None when the model is no longer declared."""
    spec = declared_models().get(task.model)
    return spec.queue if spec is not None else None


def queue_again(
    task: Task, queue: str, now: datetime, *changed: str, countdown: float = 0.0
) -> None:
    """Put a locked running task back in its model's queue, keeping its fair
    key (lease expired, or handed back), and send its job after commit."""
    task.status = Status.QUEUED
    task.worker = ""
    task.lease_expires_at = None
    task.enqueued_at = now
    task.save(update_fields=["status", "worker", "lease_expires_at", "enqueued_at", *changed])
    fairness.forget_position(task.id)
    enqueue_on_commit(task, queue, countdown=countdown)
