"""Writes that start and stop tasks, and the admission checks before them:
``admit`` (the owner's quotas, 429) and ``check_capacity`` (the model's
whole queue, 503)."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from generation.registry import ModelSpec
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.ids import new_id
from lmsp_core.status import Status

from . import fairness, lifecycle, quotas
from .event_log import EventLog
from .models import Task, UsageRecord


def admit(owner: AbstractBaseUser) -> None:
    """Lock the owner's row for the rest of the submit transaction and refuse a
    request past the owner's quotas (429 rate_limited, see ``quotas``)."""
    quotas.admit(owner)


def check_capacity(spec: ModelSpec) -> None:
    """Refuse new work for a model whose queue is full (503 overloaded)."""
    queued = Task.objects.filter(model=spec.id, status=Status.QUEUED).count()
    if queued >= settings.LMSP_MAX_QUEUED_PER_MODEL:
        raise ProblemError(
            "overloaded",
            f"{queued} requests are already waiting for {spec.id!r}; try again later.",
            headers={"Retry-After": "10"},
        )


@transaction.atomic(savepoint=False)  # part of the submit's transaction, never retried alone
def create_task(
    owner: AbstractBaseUser,
    response_id: str,
    spec: ModelSpec,
    input_tokens: int,
    kind: str,
    cost: int = 1,
) -> Task:
    """The task that generates a response (already stored in this transaction):
    log ``response.created``, count the request, and queue the job once this
    transaction commits. ``cost`` is what fair sharing charges the owner for
    it: its output token budget. Call after ``admit`` in the same
    transaction: its lock on the owner's row gives the owner's tasks their
    fair keys one at a time."""
    now = timezone.now()
    cost = max(1, cost)
    task = Task(
        id=new_id("task"),
        owner=owner,
        kind=kind,
        response_id=response_id,
        model=spec.id,
        created_at=now,
        enqueued_at=now,
        cost=cost,
        fair_key=fairness.fair_key_for(owner, spec.id),
    )
    # Numbered before the task row is written, so that one INSERT stores the
    # task with its last_event_id (the event's foreign key is checked at commit).
    EventLog.append(task, [protocol.created_event(response_id)])
    task.save(force_insert=True)
    UsageRecord.objects.create(
        response_id=response_id,
        owner=owner,
        model=spec.id,
        kind=kind,
        status=Status.IN_PROGRESS,
        input_tokens=input_tokens,
        created_at=now,
    )
    lifecycle.enqueue_on_commit(task, spec.queue)
    return task


def cancel_task(task: Task) -> Task:
    return lifecycle.request_cancel(task.id)


def cancel_abandoned(task_id: str) -> None:
    """The client of a direct request went away: stop its generation."""
    try:
        lifecycle.request_cancel(task_id)
    except (ProblemError, Task.DoesNotExist):
        pass  # already final or gone
