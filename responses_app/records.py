"""Every write of a ``Response`` but its status: create, finish, reopen,
discard and erase.

A response is built here and created with its task (``submit``), given its
outcome and reopened when the task lifecycle says so (``tasks_app.signals``,
connected in ``apps``); its status follows its task's, moved by the task's
lifecycle (``tasks_app.transitions``). It is discarded under one rule
(``discard_unneeded``, ``discard_delivered``), and erased on request or
past the retention of stored responses (``erase``, ``forget_expired``). An
erasure, an owner's deletion included (``owner_deleted``), is announced to
the model workers once it commits, so that they drop what their prefix
caches hold of that owner (``lmsp_core.erasure_news``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from lmsp_core.erasure_news import announce_erasure
from lmsp_core.ids import new_id
from lmsp_core.status import FINAL_STATUSES
from tasks_app import lifecycle
from tasks_app.endings import Outcome
from tasks_app.models import Task, TaskKind

from .models import Response

# A direct answer whose client left before it was delivered is kept this long
# after it ended, so that an answer being sent is never pulled away.
UNDELIVERED_GRACE = timedelta(seconds=60)


def new(
    owner: User,
    *,
    model: str,
    input: list[dict[str, Any]],
    params: dict[str, Any],
    store: bool,
    previous: Response | None,
    input_tokens: int,
) -> Response:
    """The response of a submit (``submit.start_generation``), unsaved: the
    submit's one statement inserts it with its task
    (``tasks_app.services.start_task``)."""
    return Response(
        id=new_id("resp"),
        owner=owner,
        model=model,
        input=input,
        params=params,
        store=store,
        previous_response=previous,
        input_tokens=input_tokens,
    )


def finish(sender: type, task: Task, outcome: Outcome, **_: object) -> None:
    """``task_finished``: the response takes the task's outcome (its status
    is the lifecycle's to move: ``tasks_app.transitions.move_response``)."""
    Response.objects.filter(id=task.response_id).update(
        output=outcome.output,
        output_tokens=outcome.output_tokens,
        cached_tokens=outcome.cached_tokens,
        error=outcome.error,
        incomplete_details=outcome.incomplete_details,
        completed_at=task.completed_at,
    )


def reopen(sender: type, task: Task, **_: object) -> None:
    """``task_reopened``: the response's outcome starts over (its status went
    back to in progress with its task's: ``tasks_app.transitions``)."""
    Response.objects.filter(id=task.response_id).update(
        output=[],
        output_tokens=0,
        cached_tokens=0,
        error=None,
        incomplete_details=None,
        completed_at=None,
    )


def discard_unneeded() -> int:
    """Delete the responses nobody can fetch again, with their tasks.

    The one rule: a ``store: false`` response whose task has ended, that no
    idempotency key can replay, and whose own reader is done with it: a
    direct answer once delivered (``discard_delivered``, at its end) or a
    grace period after it ended (here, for one whose reader left), a task's
    result once the task is past ``LMSP_TASK_RETENTION_SECONDS``. Stored
    responses stay until deleted. Returns how many rows were deleted.
    """
    now = timezone.now()
    retention = timedelta(seconds=settings.LMSP_TASK_RETENTION_SECONDS)
    unneeded = Response.objects.filter(
        Q(task__kind=TaskKind.DIRECT, task__completed_at__lt=now - UNDELIVERED_GRACE)
        | Q(task__kind=TaskKind.TASK, task__completed_at__lte=now - retention),
        store=False,
        task__status__in=FINAL_STATUSES,
        task__idempotencykey__isnull=True,
    )
    # Only the ids: the deletion needs no more, and a response's input and
    # output (a whole conversation's words) would be read for nothing.
    return unneeded.only("id").delete()[0]


# ``discard_unneeded``'s rule for one direct answer, and what deleting its
# response cascades to (``Task``'s relations), as one statement: it runs at the
# end of every direct answer, before its stream ends. Django's deletion took 11
# round trips (two reads, BEGIN, six writes, COMMIT), 6.2-7.5 ms with nothing
# else running (this: 1.4-1.6 ms); 8 streams ending together in front of vLLM
# got their ``[DONE]`` 7-224 ms after their last text (this: 0-36 ms; vLLM's
# own: 0-5 ms). The foreign keys are checked at commit (Django makes them
# deferred), so the rows go in any order. Only a stored response can be
# continued (``selectors.stored_response``): one that a later turn points to
# all the same is left to ``discard_unneeded``, which empties that turn's
# ``previous_response`` as it deletes.
_DISCARD_DELIVERED_SQL = """
WITH doomed AS (
    SELECT task.id AS task_id, task.response_id
      FROM tasks_app_task AS task
      JOIN responses_app_response AS response ON response.id = task.response_id
     WHERE task.id = %(task)s AND task.kind = %(direct)s AND task.status = ANY(%(final)s)
       AND NOT response.store
       AND NOT EXISTS (SELECT FROM tasks_app_idempotencykey AS k WHERE k.task_id = task.id)
       AND NOT EXISTS (SELECT FROM responses_app_response AS later
                        WHERE later.previous_response_id = response.id)
), events AS (
    DELETE FROM tasks_app_event WHERE task_id IN (SELECT task_id FROM doomed)
), chunks AS (
    DELETE FROM tasks_app_tokenchunk WHERE task_id IN (SELECT task_id FROM doomed)
), positions AS (
    DELETE FROM tasks_app_queueposition WHERE task_id IN (SELECT task_id FROM doomed)
), tasks AS (
    DELETE FROM tasks_app_task WHERE id IN (SELECT task_id FROM doomed)
)
DELETE FROM responses_app_response WHERE id IN (SELECT response_id FROM doomed)
"""


def discard_delivered(task_id: str) -> bool:
    """Delete the direct answer of ``task_id``, just delivered, with its task,
    if ``discard_unneeded``'s rule lets it go (``store: false``, ended, no
    idempotency key); whether it did."""
    with connection.cursor() as cursor:
        cursor.execute(
            _DISCARD_DELIVERED_SQL,
            {"task": task_id, "direct": TaskKind.DIRECT.value, "final": list(FINAL_STATUSES)},
        )
        return bool(cursor.rowcount > 0)


@transaction.atomic
def erase(responses: QuerySet[Response]) -> int:
    """Delete ``responses`` with all they left: their tasks, events, token
    chunks and idempotency keys (a retry with the key starts afresh). A
    running one stops (``lifecycle.deleting``) and its streams end. Later
    turns that continued from one stay, without it: their
    ``previous_response`` becomes empty, and since no row holds a rendered
    prompt (``prompting``), no row holds its words any more; a later turn
    queued meanwhile runs without them. Usage records stay: they hold no
    words, and the owner's token quota counts them. The model workers are
    told whose words went, once this commits. Returns how many responses
    were deleted."""
    owners = set(responses.values_list("owner_id", flat=True))
    lifecycle.deleting(Task.objects.filter(response__in=responses))
    deleted = responses.delete()[1].get(Response._meta.label, 0)
    announce_erasure(owners)
    return deleted


def owner_deleted(sender: type, instance: User, **_: object) -> None:
    """``post_delete`` of a user: everything of theirs went with them
    (``on_delete=CASCADE``); tell the model workers once it commits."""
    announce_erasure([instance.pk])


def forget_expired() -> int:
    """Erase the stored responses created more than
    ``LMSP_RESPONSE_RETENTION_DAYS`` ago and ended (0: kept until deleted)."""
    days = settings.LMSP_RESPONSE_RETENTION_DAYS
    if not days:
        return 0
    cutoff = timezone.now() - timedelta(days=days)
    expired = Response.objects.filter(store=True, created_at__lte=cutoff, status__in=FINAL_STATUSES)
    return erase(expired)
