"""Writes that start and stop tasks; a start is admitted first (the owner's
quotas and token budgets, 429, and the model's whole queue, 503)."""

from __future__ import annotations

import functools
from typing import Any

from django.conf import settings
from django.contrib.auth.models import User
from django.db import connection
from django.db.models import Model
from django.utils import timezone

from generation.registry import ModelSpec
from lmsp_core import protocol, rows
from lmsp_core.errors import ProblemError
from lmsp_core.ids import new_id
from lmsp_core.status import Status

from . import budgets, fairness, jobs, lifecycle, quotas, routing
from .event_log import EventLog
from .models import Event, Task, UsageRecord

# A submit is one query string, so one round trip and one transaction
# (PostgreSQL runs a string of statements as one unless it is already in
# one). The first two statements create the owner's quota row if missing and
# lock it. The third, with a snapshot taken after the lock (so that it counts
# the tasks of a submit that held the lock before), reads the admission's
# figures and inserts the new rows ({inserts}) only if they admit the request;
# its ``used`` part reads the owner's token budgets' periods only when one is
# set (``budgets``), and the output tokens of the minute only when the owner
# has that quota (``quotas``).
SUBMIT_SQL = """
INSERT INTO tasks_app_ownerquota (owner_id)
SELECT %(owner)s WHERE NOT EXISTS (SELECT FROM tasks_app_ownerquota WHERE owner_id = %(owner)s)
    ON CONFLICT (owner_id) DO NOTHING;
SELECT FROM tasks_app_ownerquota WHERE owner_id = %(owner)s FOR UPDATE;
WITH limits AS (
    SELECT coalesce(max_running, %(max_running)s) AS max_running,
           coalesce(max_queued, %(max_queued)s) AS max_queued,
           coalesce(output_tokens_per_minute, %(tokens_per_minute)s) AS tokens_per_minute,
           {budget_columns}
      FROM tasks_app_ownerquota WHERE owner_id = %(owner)s
),
used AS ({used}),
admission AS (
    SELECT limits.*, used.*,
           (SELECT count(*) FROM tasks_app_task
             WHERE owner_id = %(owner)s AND status = %(queued)s) AS owner_queued,
           (SELECT count(*) FROM tasks_app_task
             WHERE model = %(model)s AND status = %(queued)s) AS model_queued,
           CASE WHEN limits.tokens_per_minute = 0 THEN 0 ELSE
               (SELECT coalesce(sum(output_tokens), 0) FROM tasks_app_usagerecord
                 WHERE owner_id = %(owner)s AND completed_at >= %(minute_ago)s)
           END AS recent_tokens,
           CASE WHEN limits.tokens_per_minute = 0 THEN 0 ELSE
               (SELECT coalesce(sum(cost), 0) FROM tasks_app_task
                 WHERE owner_id = %(owner)s AND status = ANY(%(live)s))
           END AS reserved_tokens,
           {fair_key} AS fair_key
      FROM limits, used
),
admitted AS (
    SELECT fair_key AS admitted_fair_key FROM admission
     WHERE (max_queued = 0 OR owner_queued < max_queued)
       AND (tokens_per_minute = 0 OR recent_tokens + reserved_tokens
            + LEAST(%(cost)s, tokens_per_minute) <= tokens_per_minute)
       AND model_queued < %(max_model_queued)s{budgets_admit}
){inserts}
SELECT max_running, max_queued, tokens_per_minute, owner_queued, model_queued, fair_key,
       recent_tokens, reserved_tokens,
       {budget_columns}, input_day, output_day, input_month, output_month,
       EXISTS (SELECT FROM admitted)
  FROM admission
"""


def _insert_if_admitted(model: type[Model], record: str) -> str:
    """A CTE of ``SUBMIT_SQL`` that inserts a row of ``model`` if the request
    is admitted, from the JSON ``record`` (an SQL expression: ``as_record``'s
    parameter, or that with columns set from ``admitted``)."""
    table = model._meta.db_table
    columns = [f'"{column}"' for column in rows.inserted_columns(model)]
    return (
        f",\ninsert_{table} AS (\n    INSERT INTO {table} ({', '.join(columns)})\n"
        f"    SELECT {', '.join(columns)}\n"
        f"      FROM admitted, jsonb_populate_record(NULL::{table}, {record})\n)"
    )


@functools.cache
def _submit_sql(response_model: type[Model]) -> str:
    """``SUBMIT_SQL`` for a response of ``response_model``, written once (and
    short enough for psycopg to keep it parsed)."""
    inserts = [
        _insert_if_admitted(response_model, "%(response)s::jsonb"),
        _insert_if_admitted(
            Task, "%(task)s::jsonb || jsonb_build_object('fair_key', admitted_fair_key)"
        ),
        _insert_if_admitted(Event, "%(created_event)s::jsonb"),
        _insert_if_admitted(UsageRecord, "%(usage)s::jsonb"),
    ]
    return SUBMIT_SQL.format(
        budget_columns=budgets.BUDGET_COLUMNS,
        used=budgets.USED_SQL,
        budgets_admit=budgets.ADMITS_SQL,
        fair_key=fairness.FAIR_KEY_SQL,
        inserts="".join(inserts),
    )


def start_task(
    owner: User,
    spec: ModelSpec,
    response: Model,
    input_tokens: int,
    kind: str,
    cost: int = 1,
    follows: str | None = None,
    token_id: int | None = None,
) -> Task:
    """Store ``response`` (its app's row, built unsaved) and the task that
    generates it, with the task's ``response.created`` event and its usage
    record, if the owner's quotas and token budgets (429 rate_limited, see
    ``quotas`` and ``budgets``; what the budgets have left is set on the
    task's ``budget_remaining``) and the
    model's whole queue (503 overloaded) admit the request; queue the job
    once committed. All in one statement: the owner's row is locked, the
    figures read and the rows inserted in one round trip, where the ORM's
    BEGIN, lock, admission read, four inserts and COMMIT took nine, and the
    first token of a lone request waits for all of them.

    ``cost`` is what fair sharing charges the owner for the task: its output
    token budget. Under the owner's lock its tasks get their fair keys one at
    a time (``fairness.FAIR_KEY_SQL``). ``follows``: the response this one
    continues, whose worker it is sent to if it can (``routing``).
    ``token_id``: the token it was submitted with (``Task.token``)."""
    now = timezone.now()
    task = Task(
        id=new_id("task"),
        owner=owner,
        token_id=token_id,
        kind=kind,
        response_id=response.pk,
        model=spec.id,
        created_at=now,
        enqueued_at=now,
        cost=max(1, cost),
    )
    usage = UsageRecord(
        response_id=response.pk,
        owner=owner,
        model=spec.id,
        kind=kind,
        status=Status.IN_PROGRESS,
        input_tokens=input_tokens,
        created_at=now,
    )
    announced, (created_event,) = EventLog.numbered(task, [protocol.created_event(response.pk)])
    params: dict[str, Any] = {
        "owner": owner.pk,
        "model": spec.id,
        "queued": Status.QUEUED.value,
        "live": fairness.LIVE_VALUES,
        "max_running": settings.LMSP_QUOTA_MAX_RUNNING,
        "max_queued": settings.LMSP_QUOTA_MAX_QUEUED,
        "tokens_per_minute": settings.LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE,
        "minute_ago": now - quotas.TOKEN_WINDOW,
        "max_model_queued": settings.LMSP_MAX_QUEUED_PER_MODEL,
        "input_tokens": input_tokens,
        "cost": task.cost,
        **budgets.sql_params(owner.pk, now),
        "response": rows.as_record(response),
        "task": rows.as_record(task),
        "created_event": rows.as_record(created_event),
        "usage": rows.as_record(usage),
    }
    with connection.cursor() as cursor:
        cursor.execute(_submit_sql(type(response)), params)
        cursor.nextset()  # the quota row created if missing
        cursor.nextset()  # and locked
        row = cursor.fetchone()
    *limits, owner_queued, model_queued, fair_key, delivered, reserved = row[:8]
    owner_budgets = budgets.budgets_of(row[8:12], row[12:16])
    if not row[16]:  # not admitted
        use = quotas.TokenUse(delivered, reserved, task.cost)
        quotas.admit(owner.pk, quotas.Limits(*limits), owner_queued, use, now)  # 429 if a quota
        budgets.refuse_if_over(owner_budgets, input_tokens, now)  # or a budget
        raise ProblemError(  # else the model's queue is full
            "overloaded",
            f"{model_queued} requests are already waiting for {spec.id!r}; try again later.",
            headers={"Retry-After": "10"},
        )
    task.fair_key = fair_key
    task.budget_remaining = budgets.header_value(owner_budgets, input_tokens, task.cost)
    # What its first follower in this process need not read back (``streams``).
    task.events_at_creation = announced
    jobs.enqueue_on_commit(task, *routing.queue_for(spec, follows))
    return task


def cancel_task(task: Task) -> Task:
    return lifecycle.request_cancel(task.id)


def cancel_abandoned(task_id: str) -> None:
    """The client of a direct request went away: stop its generation."""
    try:
        lifecycle.request_cancel(task_id)
    except (ProblemError, Task.DoesNotExist):
        pass  # already final or gone
