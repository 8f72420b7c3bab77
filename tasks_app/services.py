"""Writes that start and stop tasks, and the admission check before them:
``admit`` (the owner's quotas, 429, and the model's whole queue, 503)."""

from __future__ import annotations

from dataclasses import dataclass

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import connection, transaction
from django.utils import timezone

from generation.registry import ModelSpec
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.ids import new_id
from lmsp_core.status import Status

from . import fairness, lifecycle, quotas
from .event_log import EventLog
from .models import Task, UsageRecord

# What a submit reads once the owner's row is locked, in one statement: the
# owner's queued tasks (its quota), the model's (its capacity) and the new
# task's fair key.
ADMISSION_SQL = f"""
SELECT (SELECT count(*) FROM tasks_app_task WHERE owner_id = %(owner)s AND status = %(queued)s),
       (SELECT count(*) FROM tasks_app_task WHERE model = %(model)s AND status = %(queued)s),
       {fairness.FAIR_KEY_SQL}
"""


@dataclass(frozen=True)
class Admission:
    """A submit let in (``admit``): the fair key its task gets."""

    fair_key: int


def admit(owner: AbstractBaseUser, spec: ModelSpec) -> Admission:
    """Lock the owner's row for the rest of the submit transaction, then refuse
    a request past the owner's quotas (429 rate_limited, see ``quotas``) or
    for a model whose queue is full (503 overloaded)."""
    limits = quotas.limits_of(quotas.lock_owner(owner.pk))
    with connection.cursor() as cursor:
        cursor.execute(
            ADMISSION_SQL,
            {
                "owner": owner.pk,
                "model": spec.id,
                "queued": Status.QUEUED.value,
                "live": fairness.LIVE_VALUES,
            },
        )
        owner_queued, model_queued, fair_key = cursor.fetchone()
    quotas.admit(owner.pk, limits, owner_queued)
    if model_queued >= settings.LMSP_MAX_QUEUED_PER_MODEL:
        raise ProblemError(
            "overloaded",
            f"{model_queued} requests are already waiting for {spec.id!r}; try again later.",
            headers={"Retry-After": "10"},
        )
    return Admission(fair_key)


@transaction.atomic(savepoint=False)  # part of the submit's transaction, never retried alone
def create_task(
    owner: AbstractBaseUser,
    admission: Admission,
    response_id: str,
    spec: ModelSpec,
    input_tokens: int,
    kind: str,
    cost: int = 1,
) -> Task:
    """The task that generates a response (already stored in this transaction):
    log ``response.created``, count the request, and queue the job once this
    transaction commits. ``cost`` is what fair sharing charges the owner for
    it: its output token budget. ``admission`` is what ``admit`` returned
    in the same transaction: under its lock on the owner's row the owner's
    tasks get their fair keys one at a time."""
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
        fair_key=admission.fair_key,
    )
    # Numbered before the task row is written, so that one INSERT stores the
    # task with its last_event_id (the event's foreign key is checked at commit).
    EventLog.append(task, [protocol.created_event(response_id)], new_task=True)
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
