"""Fair sharing of a model's queue between owners: which queued task a free
slot takes, and where a waiting task stands.

The rule is start-time fair queueing by output tokens. Each model has a
virtual clock (``ModelClock``): the fair key of the last task claimed. A task
is charged its output token budget (``cost``, its ``max_output_tokens``) and
gets, when submitted, the fair key

    max(clock, the largest fair_key + cost among the owner's queued and
        running tasks of that model)

so an owner's tasks follow one another at intervals of their cost, while an
owner with nothing waiting or running starts at the clock, level with the
tasks being served now. A free slot takes the queued task with the smallest
(fair_key, created_at, id): with four owners always waiting, each is served
the same number of tokens in turn; one owner's 500 tasks are spread out in
virtual time, so another owner's one task is served next. Idle time is not
saved up: an owner who comes back starts at the clock, not in the past.

Celery stays the delivery path: a job's message is a slot for its model
(``claims.claim``). The choice is made here, in PostgreSQL, by one claim
at a time per model (the clock row is locked), skipping task rows other
transactions hold (``FOR UPDATE SKIP LOCKED``), so it holds with any number
of workers, machines and threads calling ``claim`` at once.

Queue position: 1 + the queued tasks of the model ahead of it in that
order. A new owner's task can take a place ahead of tasks already waiting
(that is what fairness means), which would move them back; a position once
reported is a promise, so the reported one is the lowest seen in this stay
in the queue (``QueuePosition``, lowered in one statement): it never goes
up, and it can be ahead of the exact order while newcomers are served. It
starts afresh when a task is queued again (a lost worker, a re-queue).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from django.db import connection
from django.db.models import Model, Q

from lmsp_core.rows import columns, from_row
from lmsp_core.status import Status

from . import entitlement, quotas
from .locking import locked_row
from .models import ModelClock, QueuePosition, Task

LIVE = (Status.QUEUED, Status.IN_PROGRESS)
FAIR_ORDER = ("fair_key", "created_at", "id")


# The fair key of a new task of %(owner)s for %(model)s, as a SELECT
# expression: the clock, or the end of the owner's live tasks of the model if
# later. Read under the owner's lock (``tasks_app.services.start_task``), so that
# the owner's tasks get keys one after the other.
FAIR_KEY_SQL = """
GREATEST(
    (SELECT virtual_time FROM tasks_app_modelclock WHERE model = %(model)s),
    (SELECT max(fair_key + cost) FROM tasks_app_task
      WHERE owner_id = %(owner)s AND model = %(model)s AND status = ANY(%(live)s)),
    0)
"""
LIVE_VALUES = [status.value for status in LIVE]


def lock_clock(task_id: str, model: str | None = None) -> ModelClock | None:
    """The clock of ``model`` (else of ``task_id``'s model), locked until the
    transaction ends: one statement once the model has a clock. None when
    neither names a model."""
    with connection.cursor() as cursor:
        cursor.execute(LOCK_CLOCK_SQL, {"task": task_id, "model": model})
        row = cursor.fetchone()
    if row is not None:
        return from_row(ModelClock, ["model", "virtual_time"], row)
    # The model's first claim (or no model).
    if model is None:
        model = Task.objects.filter(id=task_id).values_list("model", flat=True).first()
    return None if model is None else locked_row(ModelClock, model=model)


# The model a claim is for: the one its message names, else that of the task
# it was sent for (%(task)s), whose clock the claim locks.
CLAIMED_MODEL_SQL = "coalesce(%(model)s, (SELECT model FROM tasks_app_task WHERE id = %(task)s))"
LOCK_CLOCK_SQL = f"""
SELECT model, virtual_time FROM tasks_app_modelclock WHERE model = {CLAIMED_MODEL_SQL} FOR UPDATE
"""
# The clock of a model's first claim (nothing when it exists or there is no model).
CREATE_CLOCK_SQL = f"""
INSERT INTO tasks_app_modelclock (model, virtual_time)
SELECT claimed.model, 0 FROM (SELECT {CLAIMED_MODEL_SQL} AS model) AS claimed
 WHERE claimed.model IS NOT NULL
   AND NOT EXISTS (SELECT FROM tasks_app_modelclock WHERE model = claimed.model)
    ON CONFLICT (model) DO NOTHING
"""


def take_fairest(
    clock: ModelClock, refused: Callable[[Task], None], preferred: str | None = None
) -> Task | None:
    """Lock and return the queued task of the (locked) ``clock``'s model a free
    slot should take (the ``preferred`` one first), with its response, or None
    (nothing queued, or every waiting owner at its running quota). A task
    that may no longer run (``refusal``) is handed, locked, to ``refused``,
    which ends it, and the next one is taken. Call inside the claiming
    transaction."""
    passed_over: list[int] = []  # owners at their running quota
    while True:
        with connection.cursor() as cursor:
            cursor.execute(
                fairest_sql(preferring=preferred is not None),
                {
                    "model": clock.model,
                    "queued": Status.QUEUED.value,
                    "passed_over": passed_over,
                    "preferred": preferred,
                },
            )
            row = cursor.fetchone()
        if row is None:
            return None
        task = picked_task(row)
        if refusal(task) is not None:
            refused(task)
            continue
        if quotas.may_start(task.owner_id, own_max_running(task)):
            break
        passed_over.append(task.owner_id)
    if task.fair_key > clock.virtual_time:  # as in the claim's one statement (lifecycle)
        clock.virtual_time = task.fair_key
        clock.save(update_fields=["virtual_time"])
    return task


# The claim's pick, in SQL written once rather than compiled by the ORM at
# every claim (a third of the claim's CPU, on the way to the first token): the
# fairest queued task of %(model)s (an SQL expression), locked (NO KEY UPDATE:
# rows only key-shared, by an event or a position being written for the task,
# are not skipped), read with what the run needs first (its response, its
# columns prefixed ``r_``), why it may not run if it may not
# (``entitlement``: picked anyway, to be ended) and whether the owner has a
# running limit of its own to check (``own_max_running``). ``preferring``: the task %(preferred)s
# goes first while it is queued (a job sent to one worker for it).
@functools.cache
def fairest_sql(model: str = "%(model)s", preferring: bool = False) -> str:
    task = ", ".join(f't."{column}"' for column in columns(Task))
    response = ", ".join(f'r."{column}" AS "r_{column}"' for column in columns(response_model()))
    order = ", ".join(
        ["t.id = %(preferred)s DESC"] * preferring + [f"t.{name}" for name in FAIR_ORDER]
    )
    return f"""
SELECT {task}, {response},
       {entitlement.refusal_sql()} AS refusal,
       (SELECT max_running FROM tasks_app_ownerquota WHERE owner_id = t.owner_id)
           AS own_max_running
  FROM tasks_app_task AS t
  JOIN {response_model()._meta.db_table} AS r ON r.id = t.response_id
 WHERE t.model = {model} AND t.status = %(queued)s AND NOT (t.owner_id = ANY(%(passed_over)s))
 ORDER BY {order}
 LIMIT 1
   FOR NO KEY UPDATE OF t SKIP LOCKED
"""


def picked_task(row: tuple[Any, ...]) -> Task:
    """The task of a ``fairest_sql`` row (or of a row with the same columns),
    its response, ``refusal`` and ``own_max_running`` set."""
    task_names, response_names = _names(Task), _names(response_model())
    split = len(task_names)
    task = from_row(Task, task_names, row[:split])
    task.response = from_row(  # type: ignore[assignment]  # responses_app's Response
        response_model(), response_names, row[split : split + len(response_names)]
    )
    task.refusal = row[-2]  # type: ignore[attr-defined]  # read by refusal
    task.own_max_running = row[-1]  # type: ignore[attr-defined]  # read by own_max_running
    return task


def refusal(task: Task) -> str | None:
    """Why a picked task (``picked_task``) may not run, if it may not."""
    refused: str | None = getattr(task, "refusal")  # noqa: B009 - set by picked_task
    return refused


def own_max_running(task: Task) -> int | None:
    """The running limit of a picked task's owner (``picked_task``), if it has one."""
    limit: int | None = getattr(task, "own_max_running")  # noqa: B009 - set by picked_task
    return limit


def response_model() -> type[Model]:
    """The model of a task's response (``responses_app``'s, which this app
    does not import)."""
    return cast("type[Model]", Task._meta.get_field("response").related_model)


@functools.cache
def _names(model: type[Model]) -> list[str]:
    return [field.attname for field in model._meta.concrete_fields]


# One statement: the task's rank in the fair order among its model's queued
# tasks, kept in its QueuePosition row unless a lower one was reported
# before, and returned; no row when the task is not queued. Only the
# QueuePosition row is written: the task row a claim wants stays unlocked.
POSITION_SQL = """
WITH me AS (
    SELECT id, model, fair_key, created_at
      FROM tasks_app_task WHERE id = %(id)s AND status = %(queued)s
), ranked AS (
    SELECT me.id, count(q.id) + 1 AS rank
      FROM me LEFT JOIN tasks_app_task AS q
        ON q.model = me.model AND q.status = %(queued)s
       AND (q.fair_key, q.created_at, q.id) < (me.fair_key, me.created_at, me.id)
     GROUP BY me.id
)
INSERT INTO tasks_app_queueposition (task_id, reported)
SELECT id, rank FROM ranked
ON CONFLICT (task_id) DO UPDATE
   SET reported = LEAST(tasks_app_queueposition.reported, EXCLUDED.reported)
RETURNING reported
"""


def rank(task: Task) -> int:
    """The exact place of a queued task in its model's fair order now (1: next),
    as an operator sees it; clients are told ``queue_position`` instead."""
    ahead = Task.objects.filter(model=task.model, status=Status.QUEUED).filter(
        Q(fair_key__lt=task.fair_key)
        | Q(fair_key=task.fair_key, created_at__lt=task.created_at)
        | Q(fair_key=task.fair_key, created_at=task.created_at, id__lt=task.id)
    )
    return ahead.count() + 1


def queue_position_of(task_id: str) -> int | None:
    """The task's position in its model's queue (1: next), None when it is not
    queued; never higher than a position reported before in this stay."""
    with connection.cursor() as cursor:
        cursor.execute(POSITION_SQL, {"id": task_id, "queued": Status.QUEUED.value})
        row = cursor.fetchone()
    return row[0] if row else None


def forget_position(task_id: str) -> None:
    """The task enters the queue again (re-queued) or ends: its next stay
    reports positions afresh. A claim leaves the row in place (positions are
    reported only while queued) to keep the claim, on the way to the first
    token, one statement shorter."""
    QueuePosition.objects.filter(task_id=task_id).delete()


def queue_position(task: Task) -> int | None:
    """``queue_position_of`` for a task at hand (no query unless it looked queued)."""
    return queue_position_of(task.id) if task.status == Status.QUEUED else None
