"""A task's life: queued -> in_progress -> a final status.

Workers own a running task through a lease and an attempt number. Every
write of a worker goes through ``record_progress(_many)`` or ``finish``, which lock
the task row and check that the worker's attempt is still the current one,
so a worker presumed dead (its lease expired and the task was handed on)
can never add to the log again. The sweeper hands on expired leases and
re-sends queued tasks whose broker message was lost (``tasks_app.broker``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import QuerySet
from django.utils import timezone

from generation.output import TEXT_DELTA_EVENTS, OutputAssembler
from generation.registry import declared_models
from lmsp_core import protocol, rows
from lmsp_core.celery_app import app as celery_app
from lmsp_core.errors import ProblemError, problem
from lmsp_core.status import FINAL_STATUSES, Status

from . import broker, entitlement, fairness, notify, quotas, usage
from .event_log import EventLog, StoredEvent
from .models import Event, Task, TokenChunk
from .signals import task_finished, task_reopened

if TYPE_CHECKING:
    from django.contrib.auth.models import User

log = logging.getLogger(__name__)

RUN_TASK = "workers.tasks.run_task"


@dataclass(frozen=True)
class Outcome:
    """How a generation ended, as stored on the response."""

    status: str
    output: list[dict[str, Any]] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the worker's prefix cache supplied
    worker_seconds: float = 0.0  # the ending attempt's time in the engine
    error: dict[str, Any] | None = None
    input_billed: bool = True  # False: refused before any engine read it (``entitlement``)
    incomplete_details: dict[str, Any] | None = None


@dataclass(frozen=True)
class Restored:
    """Where an earlier attempt of a task stopped (nothing, for a first attempt)."""

    token_ids: list[int] = field(default_factory=list)
    detokenizer: dict[str, Any] = field(default_factory=dict)
    assembler: OutputAssembler | None = None


@dataclass(frozen=True)
class Progress:
    owned: bool  # False: the task was handed on; stop without writing
    cancel_requested: bool = False


def _lease_deadline() -> datetime:
    return timezone.now() + timedelta(seconds=settings.LMSP_LEASE_SECONDS)


def enqueue_on_commit(task: Task, queue: str, preferred: bool = False) -> None:
    """Send the job once the task row is committed, so no worker sees it early."""
    enqueue_on_commit_id(task.id, task.model, queue, preferred)


def enqueue_on_commit_id(task_id: str, model: str, queue: str, preferred: bool = False) -> None:
    transaction.on_commit(lambda: send_job(task_id, model, queue, preferred))


def send_job(task_id: str, model: str, queue: str, preferred: bool = False) -> None:
    """The job of a queued task: a slot for its model (see ``claim``), so the
    message names the model too; the task may be gone when it is taken. A
    job sent to one worker's own queue (``preferred``) is that task's first."""
    try:
        celery_app.send_task(RUN_TASK, args=[task_id, model, preferred], queue=queue)
    except Exception as exc:  # broker down: the sweeper sends it again later
        log.warning("Could not enqueue %s (%s); the sweeper will retry", task_id, exc)


def _locked(task_id: str) -> Task | None:
    return Task.objects.select_for_update().filter(id=task_id).first()


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
        "lease": _lease_deadline(),
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
    task.lease_expires_at = _lease_deadline()  # as _claim_sql's claimed
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
    events, outcome = _partial_outcome(task, Status.FAILED, error)
    _finalize(task, events, dataclasses.replace(outcome, input_billed=task.attempt > 0))


def _owned(task_id: str, attempt: int) -> Task | None:
    task = _locked(task_id)
    if task is None or task.attempt != attempt or task.status != Status.IN_PROGRESS:
        return None
    return task


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
    params: list[Any] = [*tasks, Status.IN_PROGRESS, _lease_deadline()]
    params += [timezone.now(), *events] if events else []
    with connection.cursor() as cursor:
        cursor.execute(sql, params + chunks)
        written = {(row[0], row[1]): row[2:] for row in cursor.fetchall()}
    results = []
    for flush, flushed_events in zip(flushes, encoded, strict=True):
        found = written.get((flush.task_id, flush.attempt))
        if found is None:
            results.append(Progress(owned=False))
            continue
        last_event_id, cancel_requested = found
        first = last_event_id - len(flushed_events) + 1
        stored = [StoredEvent(first + i, *event) for i, event in enumerate(flushed_events)]
        if stored:
            EventLog.announce(flush.task_id, stored)
        results.append(Progress(owned=True, cancel_requested=cancel_requested))
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


def hand_back(flush: Flush, worker_seconds: float = 0.0) -> bool:
    """A worker gives a running task back to the queue (its engine needed the
    memory, or the worker is draining): its last flush is written, with the
    checkpoint the next attempt resumes from, and the task is queued again at
    once, in one transaction. It keeps its fair key, so it is claimed before
    anything queued after it; a cancel asked meanwhile ends it instead. False
    if the worker had lost the task already. ``worker_seconds``: the
    attempt's time in the engine, for the request's usage."""
    with transaction.atomic():
        if not record_progress_many([flush])[0].owned:
            return False
        task = Task.objects.select_for_update().select_related("response").get(id=flush.task_id)
        usage.add_worker_seconds(task.response_id, worker_seconds)
        if task.cancel_requested:
            _finalize(task, *_partial_outcome(task, Status.CANCELLED))
            return True
        queue = _queue_of(task)
        if queue is None:
            _fail_model_gone(task)
            return True
        task.handed_back += 1
        _queue_again(task, queue, timezone.now(), "handed_back")
    return True


def _queue_again(task: Task, queue: str, now: datetime, *changed: str) -> None:
    """Put a locked running task back in its model's queue, keeping its fair
    key (lease expired, or handed back), and send its job after commit."""
    task.status = Status.QUEUED
    task.worker = ""
    task.lease_expires_at = None
    task.enqueued_at = now
    task.save(update_fields=["status", "worker", "lease_expires_at", "enqueued_at", *changed])
    fairness.forget_position(task.id)
    enqueue_on_commit(task, queue)


def renew_lease(task_id: str, attempt: int) -> bool:
    """Extend a running task's lease; False once the task was handed on."""
    renewed = Task.objects.filter(id=task_id, attempt=attempt, status=Status.IN_PROGRESS).update(
        lease_expires_at=_lease_deadline()
    )
    return renewed == 1


@transaction.atomic
def finish(
    task_id: str, attempt: int, events: list[tuple[str, dict[str, Any]]], outcome: Outcome
) -> bool:
    """Write a worker's last events and the final result; False if it lost the task."""
    task = _owned(task_id, attempt)
    if task is None:
        return False
    _finalize(task, events, outcome)
    return True


def _finalize(task: Task, events: list[tuple[str, dict[str, Any]]], outcome: Outcome) -> None:
    """Close a locked task: its last events, its status, its response and its
    usage (``usage.end``), in one go."""
    now = timezone.now()
    EventLog.append(task, events)
    task.status = outcome.status
    task.error = outcome.error
    task.completed_at = now
    task.lease_expires_at = None
    task.checkpoint = None
    task.save()
    TokenChunk.objects.filter(task=task).delete()
    fairness.forget_position(task.id)
    task_finished.send(sender=Task, task=task, outcome=outcome)
    usage.end(
        task.response_id,
        outcome.status,
        output_tokens=outcome.output_tokens,
        cached_tokens=outcome.cached_tokens,
        worker_seconds=outcome.worker_seconds,
        now=now,
        input_billed=outcome.input_billed,
    )
    _resend_held_back(task.owner_id)


def _resend_held_back(owner_id: int) -> None:
    """A claim that passed over an owner at its running quota used up its
    message; once one of the owner's generations ends, send a slot for each
    model it still has tasks waiting for (a spare message claims nothing)."""
    if not quotas.limits_for(owner_id).max_running:
        return
    waiting = Task.objects.filter(owner_id=owner_id, status=Status.QUEUED)
    for model, task_id in waiting.order_by("model").distinct("model").values_list("model", "id"):
        enqueue_on_commit_id(task_id, model, declared_models()[model].queue)


def restore(task: Task) -> Restored:
    """What a task's checkpoint stands for: its token ids (from the chunks, up to
    the checkpoint's count) and its output assembler (text put back from the log)."""
    checkpoint = task.checkpoint
    if not checkpoint:
        return Restored()
    token_ids = [
        token_id
        for chunk in TokenChunk.objects.filter(task=task).order_by("start")
        for token_id in chunk.token_ids
    ][: checkpoint["tokens"]]
    deltas = Event.objects.filter(task=task, type__in=TEXT_DELTA_EVENTS).order_by("seq")
    assembler = OutputAssembler.restore(
        task.response_id,
        checkpoint["assembler"],
        ((event.type, json.loads(event.data)) for event in deltas.only("type", "data")),
    )
    return Restored(token_ids, checkpoint["detokenizer"], assembler)


def _partial_outcome(
    task: Task, status: str, error: dict[str, Any] | None = None
) -> tuple[list[tuple[str, dict[str, Any]]], Outcome]:
    """Close what a worker left open (its checkpoint) when the worker cannot."""
    restored = restore(task)
    assembler = restored.assembler or OutputAssembler(task.response_id)
    events = assembler.close()
    usage = protocol.usage(task.response.input_tokens, len(restored.token_ids))
    if status == Status.CANCELLED:
        events.append(protocol.cancelled_event(task.response_id, usage))
    else:
        assert error is not None  # a failure has its problem
        events.append(protocol.failed_event(task.response_id, error))
    outcome = Outcome(
        status=status,
        output=assembler.items,
        output_tokens=usage["output_tokens"],
        error=error,
    )
    return events, outcome


@transaction.atomic
def request_cancel(task_id: str) -> Task:
    """Cancel in any state: a queued task ends now, a running one at its next step."""
    task = Task.objects.select_for_update().select_related("response").get(id=task_id)
    if task.is_final:
        raise ProblemError(
            "task_not_cancellable", f"Task {task.id} is already {task.status}.", param="task_id"
        )
    if task.status == Status.QUEUED:
        _finalize(task, *_partial_outcome(task, Status.CANCELLED))
    elif not task.cancel_requested:
        task.cancel_requested = True
        task.save(update_fields=["cancel_requested"])
        transaction.on_commit(lambda: notify.publish_cancel(task_id))
    return task


@dataclass
class SweepReport:
    requeued: list[str] = field(default_factory=list)
    ended: list[str] = field(default_factory=list)  # failed (worker_lost) or cancelled
    resent: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # their model is no longer declared
    errors: list[str] = field(default_factory=list)  # raised while swept; tried again next time


def model_gone_problem(model: str) -> dict[str, Any]:
    """The error of a task whose model was removed from ``models.toml`` while
    the task waited: no worker will ever serve it."""
    return problem(
        "generation_failed",
        f"The model {model!r} is no longer served here (it was removed from the model "
        "registry); the task cannot run.",
        model=model,
    )


def _queue_of(task: Task) -> str | None:
    spec = declared_models().get(task.model)
    return spec.queue if spec is not None else None


def _fail_model_gone(task: Task) -> None:
    """Fail a locked task whose model is gone, keeping what it generated."""
    log.warning("Task %s needs the model %r, which is gone; failing it", task.id, task.model)
    _finalize(task, *_partial_outcome(task, Status.FAILED, model_gone_problem(task.model)))


def _sweep_expired(task_id: str, now: datetime, report: SweepReport) -> None:
    with transaction.atomic():
        task = Task.objects.select_for_update().select_related("response").get(id=task_id)
        lease = task.lease_expires_at
        if task.status != Status.IN_PROGRESS or lease is None or lease >= now:
            return
        if task.cancel_requested:
            _finalize(task, *_partial_outcome(task, Status.CANCELLED))
            report.ended.append(task.id)
        elif task.attempt - task.handed_back >= settings.LMSP_MAX_ATTEMPTS:
            error = problem(
                "worker_lost",
                f"The worker running this task was lost {task.attempt - task.handed_back} "
                "times; giving up.",
            )
            _finalize(task, *_partial_outcome(task, Status.FAILED, error))
            report.ended.append(task.id)
        elif (queue := _queue_of(task)) is None:
            _fail_model_gone(task)
            report.failed.append(task.id)
        else:
            log.warning("Lease of %s (attempt %s) expired; re-queueing", task.id, task.attempt)
            _queue_again(task, queue, now)
            report.requeued.append(task.id)


def _resend(task_id: str, now: datetime, report: SweepReport) -> None:
    """Send a still queued task's job again (its message is gone), or fail it
    when its model is."""
    with transaction.atomic():
        task = Task.objects.select_for_update().select_related("response").get(id=task_id)
        if task.status != Status.QUEUED:
            return
        queue = _queue_of(task)
        if queue is None:
            _fail_model_gone(task)
            report.failed.append(task.id)
            return
        task.enqueued_at = now  # sent now: the next look is a full period away
        task.save(update_fields=["enqueued_at"])
    send_job(task.id, task.model, queue)
    report.resent.append(task.id)


def sweep() -> SweepReport:
    """Hand on tasks whose worker stopped renewing its lease; re-send the jobs
    of queued tasks whose broker message is gone.

    Each task is swept on its own: one that raises is logged and left for the
    next sweep, and the others go on. A task whose model was removed from the
    registry fails with ``generation_failed`` (``model_gone_problem``).
    """
    report = SweepReport()
    now = timezone.now()
    expired = Task.objects.filter(status=Status.IN_PROGRESS, lease_expires_at__lt=now)
    for task_id in expired.values_list("id", flat=True):
        try:
            _sweep_expired(task_id, now, report)
        except Exception:
            log.exception("Sweeping the expired lease of %s failed", task_id)
            report.errors.append(task_id)
    stale = now - timedelta(seconds=settings.LMSP_REQUEUE_AFTER_SECONDS)
    waiting = list(
        Task.objects.filter(status=Status.QUEUED, enqueued_at__lt=stale).values_list("id", "model")
    )
    if not waiting:
        return report
    queues = {spec.queue for spec in declared_models().values()}
    in_broker = broker.task_ids_in_broker(queues, taken_since=stale.timestamp())
    declared = declared_models()
    if in_broker is None:  # the broker cannot be read: nothing is known lost, nor sendable
        waiting = [(task_id, model) for task_id, model in waiting if model not in declared]
    else:  # waiting their turn behind a backlog: looked at now, again a period later
        behind = [task_id for task_id, model in waiting if task_id in in_broker]
        Task.objects.filter(id__in=behind, status=Status.QUEUED).update(enqueued_at=now)
        waiting = [(task_id, model) for task_id, model in waiting if task_id not in in_broker]
    for task_id, _ in waiting:
        try:
            _resend(task_id, now, report)
        except Exception:
            log.exception("Sweeping the queued task %s failed", task_id)
            report.errors.append(task_id)
    return report


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
    queue = _queue_of(task)
    if queue is None:
        raise ProblemError("invalid_request", model_gone_problem(task.model)["detail"])
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
    task.enqueued_at = timezone.now()
    task.save()
    fairness.forget_position(task.id)
    TokenChunk.objects.filter(task=task).delete()
    task_reopened.send(sender=Task, task=task)
    enqueue_on_commit(task, queue)
    return task
