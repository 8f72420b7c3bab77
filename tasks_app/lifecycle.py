"""A task's life: queued -> in_progress -> a final status, and the changes
asked from outside a worker: a cancel, an operator's re-queue of a failed
task, the deletion of tasks (with their response or their owner).

The rest of the life has a module per concern: ``jobs`` (a queued task's
broker message), ``claims`` (a worker takes a task, under a lease and an
attempt number), ``checkpoints`` (what a running worker writes),
``endings`` (how a task ends), ``sweeper`` (lost workers and lost
messages). ``transitions`` states every change of a task row.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.status import FINAL_STATUSES, Status

from . import endings, entitlement, fairness, jobs, notify, transitions, usage
from .event_log import EventLog
from .models import Task, TokenChunk
from .signals import task_reopened

if TYPE_CHECKING:
    from django.contrib.auth.models import User


@transaction.atomic
def request_cancel(task_id: str) -> Task:
    """Cancel in any state: a queued task ends now, a running one at its next step."""
    task = Task.objects.select_for_update().select_related("response").get(id=task_id)
    if task.is_final:
        raise ProblemError(
            "task_not_cancellable", f"Task {task.id} is already {task.status}.", param="task_id"
        )
    if task.status == Status.QUEUED:
        endings.finalize(task, *endings.partial_outcome(task, Status.CANCELLED))
    elif not task.cancel_requested:
        task.cancel_requested = True
        task.save(update_fields=["cancel_requested"])
        transaction.on_commit(lambda: notify.publish_cancel(task_id))
    return task


def deleting(tasks: QuerySet[Task]) -> None:
    """Before ``tasks`` are deleted, in the same transaction: lock the
    unfinished ones (``_stop_when_deleted``); their usage records, which
    stay, end cancelled with the tokens their checkpoints hold, since no
    worker will end them."""
    now = timezone.now()
    for task in _stop_when_deleted(tasks):
        usage.end(
            task.response_id,
            Status.CANCELLED,
            output_tokens=(task.checkpoint or {}).get("tokens", 0),
            cached_tokens=0,
            worker_seconds=0.0,
            now=now,
        )


def _stop_when_deleted(tasks: QuerySet[Task]) -> list[Task]:
    """Lock the unfinished ``tasks``, in id order as every writer of several
    tasks does, so that no flush of their workers lands between the deletion
    of their events and their own (the flush then finds no task and its
    worker stops); once the deletion commits, their workers drop them at once
    (a cancel's message) and their streams end (their feeds read them
    again). Returns them."""
    assert transaction.get_connection().in_atomic_block, "deleting needs a transaction"
    unfinished = tasks.exclude(status__in=FINAL_STATUSES).select_for_update().order_by("id")
    locked = list(unfinished.only("id", "response_id", "checkpoint"))
    for task in locked:
        transaction.on_commit(functools.partial(notify.publish_cancel, task.id))
        transaction.on_commit(functools.partial(notify.publish_changed, task.id))
    return locked


def owner_deleting(sender: type, instance: User, **_: object) -> None:
    """``pre_delete`` of a user (connected in ``apps``): its tasks go with it,
    and its usage too (nothing of it is ended: a row added now would outlive
    the deletion's cascade)."""
    _stop_when_deleted(Task.objects.filter(owner_id=instance.pk))


@transaction.atomic
def requeue_failed(task_id: str) -> Task:
    """Run a failed task again (an operator's decision, from the admin).

    The attempt counter goes on from where it stopped (the next claim takes
    the next number), so no worker of an earlier attempt can write again; the
    sweeper's ``LMSP_MAX_ATTEMPTS`` counts those earlier attempts too. The log
    goes on after its ``response.failed`` with a fresh ``response.created``:
    ids never repeat, and a reader sees a new run start.
    """
    task = Task.objects.select_for_update().select_related("response").get(id=task_id)
    if task.status != Status.FAILED:
        raise ProblemError(
            "invalid_request",
            f"Task {task.id} is {task.status}; only a failed task can be re-queued.",
        )
    queue = jobs.queue_of(task)
    if queue is None:
        raise ProblemError("invalid_request", endings.model_gone_problem(task.model)["detail"])
    refusal = entitlement.refusal_of(task.id)
    if refusal is not None:  # it would end at once, unrun
        detail = entitlement.refusal_problem(refusal, task.model)["detail"]
        raise ProblemError("invalid_request", f"Task {task.id} cannot run again: {detail}")
    EventLog.append(task, [protocol.created_event(task.response_id)])
    usage.reopen(task.response_id)
    task.status = Status.QUEUED
    task.error = None
    task.completed_at = None
    task.started_at = None  # a new run: LMSP_MAX_JOB_SECONDS counts from its start
    task.worker = ""
    task.lease_expires_at = None
    task.cancel_requested = False
    task.checkpoint = None
    task.waiting_reason, task.waiting_since = "", None  # a new run waits afresh
    task.enqueued_at = timezone.now()
    task.save()
    transitions.move_response(task)
    fairness.forget_position(task.id)
    TokenChunk.objects.filter(task=task).delete()
    task_reopened.send(sender=Task, task=task)
    jobs.enqueue_on_commit(task, queue)
    return task
