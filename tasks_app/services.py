"""Writes that start and stop generation."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction
from django.utils import timezone

from responses_app import protocol
from responses_app.errors import ProblemError
from responses_app.ids import new_id
from responses_app.models import Response
from responses_app.services import PreparedGeneration

from . import lifecycle
from .event_log import EventLog
from .models import Task, TaskKind, TaskStatus, UsageRecord


@transaction.atomic
def start_generation(owner: AbstractBaseUser, prepared: PreparedGeneration, kind: str) -> Task:
    """Store the response and its task, log ``response.created``, and queue the job
    once this transaction commits."""
    spec = prepared.spec
    queued = Task.objects.filter(model=spec.id, status=TaskStatus.QUEUED).count()
    if queued >= settings.LMSP_MAX_QUEUED_PER_MODEL:
        raise ProblemError(
            "overloaded",
            f"{queued} requests are already waiting for {spec.id!r}; try again later.",
            headers={"Retry-After": "10"},
        )
    now = timezone.now()
    response = Response.objects.create(
        id=new_id("resp"),
        owner=owner,
        model=spec.id,
        input=prepared.input,
        params=prepared.params,
        store=prepared.store,
        previous_response=prepared.previous,
        prompt=prepared.prompt,
        input_tokens=prepared.input_tokens,
        created_at=now,
    )
    task = Task.objects.create(
        id=new_id("task"),
        owner=owner,
        kind=kind,
        response=response,
        model=spec.id,
        created_at=now,
        enqueued_at=now,
    )
    EventLog.append(task, [protocol.created_event(response.id)])
    task.save(update_fields=["last_event_id"])
    UsageRecord.objects.create(
        response_id=response.id,
        owner=owner,
        model=spec.id,
        kind=kind,
        status=TaskStatus.IN_PROGRESS,
        input_tokens=prepared.input_tokens,
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


def discard_unstored(task_id: str) -> None:
    """``store: false``: once delivered, nothing of a direct response is kept."""
    Response.objects.filter(
        task__id=task_id,
        task__kind=TaskKind.DIRECT,
        store=False,
        # kept for replays of the same Idempotency-Key until the key expires
        task__idempotencykey__isnull=True,
    ).delete()
