"""A worker takes a task: the fairest queued one of its model (``claim``),
held by a lease it renews (``renew_lease``) and fenced by the attempt
number the claim gives it.

A worker's every later write checks that attempt (``checkpoints``,
``endings.finish``), so a worker presumed dead (its lease expired and the
task was handed on, ``sweeper``) can never add to the log again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from lmsp_core import rows
from lmsp_core.status import Status

from . import endings, entitlement, fairness
from .models import Task

log = logging.getLogger(__name__)


def lease_deadline() -> datetime:
    """When a lease taken or renewed now expires."""
    return timezone.now() + timedelta(seconds=settings.LMSP_LEASE_SECONDS)


def claim(
    task_id: str, worker: str, model: str | None = None, preferred: str | None = None
) -> Task | None:
    """Take the fairest queued task of ``model`` (the job's message names it;
    else ``task_id``'s) for this worker (see ``fairness``); None when that
    model has nothing this worker may start. The ``preferred`` task goes
    first while it is queued (``tasks_app.routing``: a job sent to this
    worker for a conversation it holds).

    A job's message is a slot for its model rather than a ticket for one
    task: every queued task has sent one, so every queued task is claimed by
    some message, and the order is decided here, not by the broker. Safe to
    call from many threads, processes and machines at once. The task a
    message was sent for can be claimed through another message, end and be
    discarded before this one is taken: the message's model keeps its slot
    (a message without one, sent before it named its model, then claims
    nothing and the sweeper sends the waiting task's job again).

    One statement string (``_claim_sql``), on the way to a lone request's
    first token, claims the fairest task unless its owner has a running
    limit to count first or the task may no longer run (then
    ``_claim_counting_running``). A task is claimed only while its token is
    usable, its owner active and its model allowed (``entitlement``);
    otherwise it ends failed with the reason, never run (``_end_refused``).
    """
    claimed: dict[str, Any] = {
        "task": task_id,
        "model": model,
        "preferred": preferred,
        "queued": Status.QUEUED.value,
        "passed_over": [],
        "max_running": settings.LMSP_QUOTA_MAX_RUNNING,
        "in_progress": Status.IN_PROGRESS.value,
        "worker": worker,
        "lease": lease_deadline(),
    }
    with connection.cursor() as cursor:
        cursor.execute(_claim_sql(preferred is not None), claimed)
        cursor.nextset()  # the model's clock created if missing
        cursor.nextset()  # and locked
        row = cursor.fetchone()
    if row is None:
        return None  # nothing queued for the model (or no such task)
    if row[0] is None:  # picked, but its owner's running generations are to be
        # counted, or it may no longer run (``entitlement``) and is to be ended
        return _claim_counting_running(task_id, worker, model, preferred)
    return fairness.picked_task(row)


# A claim in one query string, so one round trip and one transaction. The
# model's clock is created if missing and locked (claims of a model go one at
# a time); then, with a snapshot taken after the lock, the fairest queued task
# is picked and, if its owner has no running limit and it may still run
# (``entitlement``), the clock moves on to its fair key and the task is
# claimed. Its start is the time it was claimed, read after the lock: a time
# taken before the statement would misorder claims that waited for one
# another. The row: the claimed task's columns (NULL when it
# was only picked) and its response's; none when nothing was picked.
@functools.cache
def _claim_sql(preferring: bool) -> str:
    task_columns = rows.columns(Task)
    response_columns = rows.columns(fairness.response_model())
    return f"""
{fairness.CREATE_CLOCK_SQL};
{fairness.LOCK_CLOCK_SQL};
WITH picked AS ({fairness.fairest_sql(fairness.CLAIMED_MODEL_SQL, preferring)}),
startable AS (
    SELECT id, model, fair_key FROM picked
     WHERE refusal IS NULL AND coalesce(own_max_running, %(max_running)s) = 0
),
advance_clock AS (
    UPDATE tasks_app_modelclock AS clock SET virtual_time = startable.fair_key
      FROM startable
     WHERE clock.model = startable.model AND clock.virtual_time < startable.fair_key
),
claimed AS (
    UPDATE tasks_app_task AS task
       SET status = %(in_progress)s, attempt = task.attempt + 1, worker = %(worker)s,
           started_at = coalesce(task.started_at, clock_timestamp()), lease_expires_at = %(lease)s
      FROM startable
     WHERE task.id = startable.id
 RETURNING {", ".join(f'task."{column}"' for column in task_columns)}
)
SELECT {", ".join(f'claimed."{column}"' for column in task_columns)},
       {", ".join(f'picked."r_{column}"' for column in response_columns)},
       picked.refusal, picked.own_max_running
  FROM picked LEFT JOIN claimed ON claimed.id = picked.id
"""


@transaction.atomic
def _claim_counting_running(
    task_id: str, worker: str, model: str | None, preferred: str | None
) -> Task | None:
    """``claim`` when the fairest task's owner has a running limit: the owner's
    row is locked and its running generations counted (``quotas.may_start``),
    and a slot its owner may not use goes to the next owner in the fair order;
    or when the fairest task may no longer run: it is ended
    (``_end_refused``), and so is every one behind it that may not, until one
    that may is claimed."""
    clock = fairness.lock_clock(task_id, model)
    if clock is None:
        return None
    task = fairness.take_fairest(clock, _end_refused, preferred)
    if task is None:
        return None
    now = timezone.now()
    task.status = Status.IN_PROGRESS
    task.attempt += 1
    task.worker = worker
    task.started_at = task.started_at or now
    task.lease_expires_at = lease_deadline()  # as _claim_sql's claimed
    task.save(update_fields=["status", "attempt", "worker", "started_at", "lease_expires_at"])
    return task


def _end_refused(task: Task) -> None:
    """End a picked (locked) task that may no longer run (``entitlement``):
    failed, its error saying why, and its reservation released. It is billed
    nothing, unless an earlier attempt ran (a lost worker's task queued
    again): then what that attempt was sent, as for a cancel."""
    refusal = fairness.refusal(task)
    assert refusal is not None  # take_fairest hands only refused tasks here
    log.info("Task %s may no longer run (%s); failing it", task.id, refusal)
    error = entitlement.refusal_problem(refusal, task.model)
    events, outcome = endings.partial_outcome(task, Status.FAILED, error)
    endings.finalize(task, events, dataclasses.replace(outcome, input_billed=task.attempt > 0))


def renew_lease(task_id: str, attempt: int) -> bool:
    """Extend a running task's lease; False once the task was handed on."""
    renewed = Task.objects.filter(id=task_id, attempt=attempt, status=Status.IN_PROGRESS).update(
        lease_expires_at=lease_deadline()
    )
    return renewed == 1
