"""What a running worker writes while it owns a task: flushes of its events,
its new tokens and the checkpoint a later attempt resumes from
(``record_progress_many``), and a hand-back of the task to its queue
(``hand_back``, when the worker drains).

Each write is fenced by the worker's attempt (``claims``): a flush of a
task handed on writes nothing and tells its worker to stop.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from lmsp_core import protocol
from lmsp_core.status import Status

from . import claims, endings, jobs, usage
from .event_log import EventLog, StoredEvent
from .models import Task
from .upstream_waits import Waiting


@dataclass(frozen=True)
class Progress:
    owned: bool  # False: the task was handed on; stop without writing
    cancel_requested: bool = False


@dataclass(frozen=True)
class Flush:
    """What one run writes at a flush: its events and the tokens it generated
    since its last flush, with the checkpoint they lead to.
    ``checkpoint["tokens"]`` counts every token so far, ``new_token_ids``
    included."""

    task_id: str
    attempt: int
    events: list[tuple[str, dict[str, Any]]]
    new_token_ids: list[int]
    checkpoint: dict[str, Any]


def record_progress(
    task_id: str,
    attempt: int,
    events: list[tuple[str, dict[str, Any]]],
    new_token_ids: list[int],
    checkpoint: dict[str, Any],
) -> Progress:
    """Append one worker's flush and renew its lease (see ``Flush``)."""
    return record_progress_many([Flush(task_id, attempt, events, new_token_ids, checkpoint)])[0]


def record_progress_many(flushes: list[Flush]) -> list[Progress]:
    """Write the flushes of several running tasks in one statement, each
    fenced by its attempt; returns each one's ``Progress``, in order.

    A worker decoding a batch flushes its rows together, and a lone run's
    first flush is on the way to the token its user waits for: one
    statement whatever the number of rows (``FLUSH_SQL``), where BEGIN, a
    lock query, two inserts, an update and COMMIT took 2-3 ms of the
    worker's and PostgreSQL's CPU, and one transaction per row took the
    worker's CPU from the decoding thread.
    """
    encoded = [[(name, protocol.dumps(data)) for name, data in flush.events] for flush in flushes]
    tasks, events, chunks = [], [], []
    for flush, flushed_events in zip(flushes, encoded, strict=True):
        tasks += [flush.task_id, flush.attempt, len(flushed_events), json.dumps(flush.checkpoint)]
        for from_end, (name, data) in enumerate(reversed(flushed_events)):
            events += [flush.task_id, flush.attempt, from_end, name, data]
        if flush.new_token_ids:
            start = flush.checkpoint["tokens"] - len(flush.new_token_ids)
            chunks += [flush.task_id, flush.attempt, start, json.dumps(flush.new_token_ids)]
    sql = FLUSH_SQL.format(
        tasks=_values(4, len(tasks)),
        new_events=FLUSH_EVENTS_SQL.format(events=_values(5, len(events))) if events else "",
        new_chunks=FLUSH_CHUNKS_SQL.format(chunks=_values(4, len(chunks))) if chunks else "",
    )
    params: list[Any] = [*tasks, Status.IN_PROGRESS, claims.lease_deadline()]
    params += [timezone.now(), *events] if events else []
    with connection.cursor() as cursor:
        cursor.execute(sql, params + chunks)
        written = {(row[0], row[1]): row[2:] for row in cursor.fetchall()}
    results: list[Progress] = []
    announced: dict[str, list[StoredEvent]] = {}
    for flush, flushed_events in zip(flushes, encoded, strict=True):
        found = written.get((flush.task_id, flush.attempt))
        if found is None:
            results.append(Progress(owned=False))
            continue
        last_event_id, cancel_requested = found
        first = last_event_id - len(flushed_events) + 1
        if flushed_events:
            announced[flush.task_id] = [
                StoredEvent(first + i, *event) for i, event in enumerate(flushed_events)
            ]
        results.append(Progress(owned=True, cancel_requested=cancel_requested))
    if announced:
        EventLog.announce(announced)
    return results


# The rows of the tasks whose attempt is still current are locked in id order
# (the order every multi-row writer keeps), their last event id moved on by
# their events' count, and the events numbered back from it; a flush of a task
# handed on writes nothing. Events and token chunks carry the attempt so that
# two flushes of one task (a stale attempt beside the current one) never mix.
FLUSH_SQL = """
WITH flushed (id, attempt, events, checkpoint) AS (VALUES {tasks}),
locked AS (
    SELECT task.id FROM tasks_app_task AS task JOIN flushed USING (id)
     WHERE task.attempt = flushed.attempt AND task.status = %s
     ORDER BY task.id FOR UPDATE OF task
),
progress AS (
    UPDATE tasks_app_task AS task
       SET last_event_id = task.last_event_id + flushed.events,
           checkpoint = flushed.checkpoint::jsonb, lease_expires_at = %s
      FROM flushed JOIN locked USING (id)
     WHERE task.id = flushed.id AND task.attempt = flushed.attempt
 RETURNING task.id, task.attempt, task.last_event_id, task.cancel_requested
){new_events}{new_chunks}
SELECT id, attempt, last_event_id, cancel_requested FROM progress
"""
FLUSH_EVENTS_SQL = """,
new_events AS (
    INSERT INTO tasks_app_event (task_id, seq, type, data, created_at)
    SELECT added.id, progress.last_event_id - added.from_end, added.type, added.data, %s
      FROM (VALUES {events}) AS added (id, attempt, from_end, type, data)
      JOIN progress USING (id, attempt)
)"""
FLUSH_CHUNKS_SQL = """,
new_chunks AS (
    INSERT INTO tasks_app_tokenchunk (task_id, start, token_ids)
    SELECT added.id, added.start, added.token_ids::jsonb
      FROM (VALUES {chunks}) AS added (id, attempt, start, token_ids)
      JOIN progress USING (id, attempt)
)"""


def _values(width: int, params: int) -> str:
    """``(%s, %s::integer, ...)`` rows for ``params`` parameters, ``width`` a
    row: an id, then integers, then text."""
    row = "(" + ", ".join(["%s", "%s::integer", "%s::integer"][:width] + ["%s"] * (width - 3)) + ")"
    return ", ".join([row] * (params // width))


def hand_back(flush: Flush, worker_seconds: float = 0.0, waiting: Waiting | None = None) -> bool:
    """A worker gives a running task back to the queue (its engine needed the
    memory, or the worker is draining): its last flush is written, with the
    checkpoint the next attempt resumes from, and the task is queued again at
    once, in one transaction. It keeps its fair key, so it is claimed before
    anything queued after it; a cancel asked meanwhile ends it instead. False
    if the worker had lost the task already. ``worker_seconds``: the
    attempt's time in the engine, for the request's usage. ``waiting``: its
    upstream server could not take it (``upstream_waits``): it waits queued,
    saying why, and is tried again after a delay; or, having waited its
    model's limit, it fails."""
    with transaction.atomic():
        if not record_progress_many([flush])[0].owned:
            return False
        task = Task.objects.select_for_update().select_related("response").get(id=flush.task_id)
        usage.add_worker_seconds(task.response_id, worker_seconds)
        if task.cancel_requested:
            endings.finalize(task, *endings.partial_outcome(task, Status.CANCELLED))
            return True
        queue = jobs.queue_of(task)
        if queue is None:
            endings.fail_model_gone(task)
            return True
        now, countdown, changed = timezone.now(), 0.0, ["handed_back"]
        if waiting is not None:
            delay = waiting.delay(task, now)
            if delay is None:
                error = waiting.gave_up(task, now)
                endings.finalize(task, *endings.partial_outcome(task, Status.FAILED, error))
                return True
            countdown, changed = delay, [*changed, "waiting_reason", "waiting_since"]
        task.handed_back += 1
        jobs.queue_again(task, queue, now, *changed, countdown=countdown)
    return True
