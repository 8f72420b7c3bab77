"""Usage accounting when a request ends: its usage record is completed and the
request is added, all its figures at once, to its owner's ``DailyUsage`` row
(the UTC day it was accepted), in one statement inside the transaction that
ends it. The record moves from ``in_progress`` to its final status only once,
so a request is counted once, whatever retries, hand-backs or stale attempts
come after; an operator's re-run of a failed task (``reopen``) takes it out
of its day first, and its new end adds it again.

``worker_seconds`` is the time a request spent in workers' engines: each
attempt's, from its submit to the engine to its last token (a wait for a
batch slot included; loading the model, time in the queue and an attempt
whose worker died are not). An attempt handed back adds its time then
(``add_worker_seconds``), the last one when it ends; a request that never
reached an engine has 0. ``cached_tokens`` are the prompt tokens
the prefix cache supplied to the attempt that ended it (0 when the worker
did not end it: a cancel while queued, a lost worker, an erasure).
"""

from __future__ import annotations

from datetime import datetime

from django.db import connection

from lmsp_core.status import Status

# The day of a usage record, as DailyUsage keys it.
DAY_SQL = "(created_at AT TIME ZONE 'UTC')::date"
FIGURES = ("input_tokens", "output_tokens", "cached_tokens", "worker_seconds")

# Adds the rows of ``ended`` (owner_id, model, created_at and FIGURES) to their days.
ADD_TO_DAYS_SQL = f"""
INSERT INTO tasks_app_dailyusage AS daily
       (owner_id, model, day, requests, {", ".join(FIGURES)})
SELECT owner_id, model, {DAY_SQL}, count(*), {", ".join(f"sum({f})" for f in FIGURES)}
  FROM ended GROUP BY owner_id, model, {DAY_SQL}
    ON CONFLICT (owner_id, model, day) DO UPDATE
   SET requests = daily.requests + excluded.requests,
       {", ".join(f"{f} = daily.{f} + excluded.{f}" for f in FIGURES)}
"""

END_SQL = f"""
WITH ended AS (
    UPDATE tasks_app_usagerecord
       SET status = %(status)s, output_tokens = %(output_tokens)s,
           input_tokens = CASE WHEN %(input_billed)s THEN input_tokens ELSE 0 END,
           cached_tokens = %(cached_tokens)s,
           worker_seconds = worker_seconds + %(worker_seconds)s,
           completed_at = %(completed_at)s
     WHERE response_id = %(response_id)s AND status = %(in_progress)s
 RETURNING owner_id, model, created_at, {", ".join(FIGURES)}
)
{ADD_TO_DAYS_SQL}
"""

REOPEN_SQL = f"""
WITH ended AS (
    SELECT id, owner_id, model, created_at, {", ".join(FIGURES)} FROM tasks_app_usagerecord
     WHERE response_id = %(response_id)s AND status <> %(in_progress)s FOR UPDATE
),
reopened AS (
    UPDATE tasks_app_usagerecord AS record
       SET status = %(in_progress)s, output_tokens = 0, cached_tokens = 0, completed_at = NULL
      FROM ended WHERE record.id = ended.id
)
UPDATE tasks_app_dailyusage AS daily
   SET requests = daily.requests - 1,
       {", ".join(f"{f} = daily.{f} - ended.{f}" for f in FIGURES)}
  FROM ended
 WHERE daily.owner_id = ended.owner_id AND daily.model = ended.model
   AND daily.day = (ended.created_at AT TIME ZONE 'UTC')::date
"""


def end(
    response_id: str,
    status: str,
    *,
    output_tokens: int,
    cached_tokens: int,
    worker_seconds: float,
    now: datetime,
    input_billed: bool = True,
) -> None:
    """Complete the request's usage record (``worker_seconds``: its last
    attempt's) and add it to its day, unless it was completed already (then
    nothing changes). ``input_billed`` False: its input tokens are not
    charged (a task refused before it ever ran, ``tasks_app.entitlement``)."""
    with connection.cursor() as cursor:
        cursor.execute(
            END_SQL,
            {
                "response_id": response_id,
                "status": status,
                "output_tokens": output_tokens,
                "cached_tokens": cached_tokens,
                "worker_seconds": worker_seconds,
                "completed_at": now,
                "in_progress": Status.IN_PROGRESS.value,
                "input_billed": input_billed,
            },
        )


def add_worker_seconds(response_id: str, seconds: float) -> None:
    """An attempt handed back: its time goes on the request's record, which
    its day gets when the request ends."""
    with connection.cursor() as cursor:
        cursor.execute(
            "UPDATE tasks_app_usagerecord SET worker_seconds = worker_seconds + %s"
            " WHERE response_id = %s AND status = %s",
            [seconds, response_id, Status.IN_PROGRESS.value],
        )


def reopen(response_id: str) -> None:
    """A failed request runs again: it leaves its day's figures and its
    record is in progress again, until its new end adds it back (with the
    failed run's worker time, which was spent, but its new run's tokens)."""
    with connection.cursor() as cursor:
        cursor.execute(
            REOPEN_SQL, {"response_id": response_id, "in_progress": Status.IN_PROGRESS.value}
        )
