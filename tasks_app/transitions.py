"""The task lifecycle as a state machine: every change of a task row, stated.

A task's row is written by a handful of SQL statements spread over
``services`` (the submit's one statement), ``claims``, ``checkpoints``
(flushes, hand-backs), ``jobs`` (back to the queue), ``endings``,
``sweeper``, ``lifecycle`` (cancels, an operator's re-queue) and
``retention``. This
table says, for each change, from which statuses to which it goes, which
columns it may set, and which code writes it (``writers``: the functions, or
the SQL constants, whose statements touch the row). ``tests/test_transitions.py``
runs every transition against PostgreSQL with a trigger that records each
change of the row, checks it against its line here, and checks that the
code's writers of the task table are exactly the ones named here: a new
path that changes a task needs a line.

A task's response has a status of its own, which the protocol shows and
which outlives the task (``responses_app.retention`` forgets the tasks of
stored responses and keeps the responses, and a final status cannot be told
from the response's output alone). It is not a second state machine: it is
``RESPONSE_STATUS`` of its task's status, so each line also says how it moves
the response (``Transition.response_moves``), and the lifecycle writes it
through one function (``move_response``), in the task's transaction,
whichever line moves it; the test records the response rows too.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmsp_core.status import FINAL_STATUSES, Status

from .models import Task

QUEUED, IN_PROGRESS = Status.QUEUED.value, Status.IN_PROGRESS.value
FINAL = frozenset(str(status) for status in FINAL_STATUSES)
# What closing a task writes (``endings.finalize``): its last events, the
# status, the error, the end time; the lease and the checkpoint go.
CLOSED_FIELDS = frozenset(
    {"status", "error", "completed_at", "lease_expires_at", "checkpoint", "last_event_id"}
)

# What a flush writes (``checkpoints.FLUSH_SQL``), and what putting a running
# task back in its queue does (``jobs.queue_again``).
FLUSHED_FIELDS = frozenset({"last_event_id", "checkpoint", "lease_expires_at"})
QUEUED_AGAIN_FIELDS = frozenset({"status", "worker", "lease_expires_at", "enqueued_at"})
# Why a task waits for its upstream server, and since when (``upstream_waits``).
WAITING_FIELDS = frozenset({"waiting_reason", "waiting_since"})

# The status of a task's response, for each status of the task: in progress
# while the task waits or runs, then the task's own final status.
RESPONSE_STATUS: dict[str, str] = {QUEUED: IN_PROGRESS, IN_PROGRESS: IN_PROGRESS} | {
    status: status for status in FINAL
}


@dataclass(frozen=True)
class Transition:
    """One kind of change of a task row: ``sources`` -> ``targets`` (None: the
    row is created), setting only ``fields``."""

    sources: frozenset[str | None]
    targets: frozenset[str]
    fields: frozenset[str]
    writers: tuple[str, ...]  # module.function (or module.CONSTANT) whose SQL writes it
    why: str

    def allows(self, before: str | None, after: str, changed: frozenset[str]) -> bool:
        """Whether a change of a row from status ``before`` to ``after``,
        setting the columns ``changed``, is this transition (a status that
        is not among ``fields`` stays as it was)."""
        sets = changed <= self.fields or "*" in self.fields
        return before in self.sources and after in self.targets and sets

    @property
    def response_moves(self) -> frozenset[tuple[str | None, str]]:
        """How it moves the status of the task's response, (before, after)
        (None: the response is created): empty when it leaves it as it is."""
        sets_status = {"status", "*"} & self.fields
        moves = {
            (None if before is None else RESPONSE_STATUS[before], RESPONSE_STATUS[after])
            for before in self.sources
            for after in self.targets
            if sets_status or before == after
        }
        return frozenset((before, after) for before, after in moves if before != after)


def _t(
    sources: set[str | None] | frozenset[str],
    targets: set[str] | frozenset[str],
    fields: set[str] | frozenset[str],
    writers: tuple[str, ...],
    why: str,
) -> Transition:
    return Transition(frozenset(sources), frozenset(targets), frozenset(fields), writers, why)


# Named by the public function that makes the change (and its case).
TRANSITIONS: dict[str, Transition] = {
    "services.start_task": _t(
        {None},
        {QUEUED},
        {"*"},  # the whole new row
        ("services._submit_sql",),
        "a submit admitted by the owner's quotas and the model's queue",
    ),
    "claims.claim": _t(
        {QUEUED},
        {IN_PROGRESS},
        {"status", "attempt", "worker", "started_at", "lease_expires_at"},
        ("claims._claim_sql", "claims._claim_counting_running"),
        "a worker takes the fairest queued task: the next attempt, a lease",
    ),
    "claims.claim (may no longer run)": _t(
        {QUEUED},
        {Status.FAILED.value},
        CLOSED_FIELDS,
        ("endings.finalize",),
        "a queued task whose token, owner or model may no longer be used ends, never run",
    ),
    "checkpoints.record_progress": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        FLUSHED_FIELDS,
        ("checkpoints.FLUSH_SQL",),
        "a flush of the current attempt: events, checkpoint, lease renewed",
    ),
    "claims.renew_lease": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        {"lease_expires_at"},
        ("claims.renew_lease",),
        "the current attempt keeps its lease",
    ),
    "endings.finish": _t(
        {IN_PROGRESS},
        FINAL,
        CLOSED_FIELDS,
        ("endings.finalize",),
        "the current attempt writes its last events and the outcome",
    ),
    "lifecycle.request_cancel (queued)": _t(
        {QUEUED},
        {Status.CANCELLED.value},
        CLOSED_FIELDS,
        ("endings.finalize",),
        "a queued task ends at once",
    ),
    "lifecycle.request_cancel (running)": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        {"cancel_requested"},
        ("lifecycle.request_cancel",),
        "a running task is asked to stop; its worker ends it",
    ),
    "checkpoints.hand_back": _t(
        {IN_PROGRESS},
        {IN_PROGRESS, QUEUED},  # its last flush, then the queue, in one transaction
        {*FLUSHED_FIELDS, *QUEUED_AGAIN_FIELDS, "handed_back"},
        ("checkpoints.FLUSH_SQL", "jobs.queue_again"),
        "a worker gives its running task back (its engine needed the memory, or it drains): "
        "its last flush, then the queue at once, its fair key kept, no attempt counted lost",
    ),
    "checkpoints.hand_back (cancelled meanwhile)": _t(
        {IN_PROGRESS},
        {IN_PROGRESS, Status.CANCELLED.value},  # its last flush, then the end
        FLUSHED_FIELDS | CLOSED_FIELDS,
        ("checkpoints.FLUSH_SQL", "endings.finalize"),
        "a task handed back after a cancel was asked ends cancelled instead",
    ),
    "checkpoints.hand_back (upstream unavailable)": _t(
        {IN_PROGRESS},
        {IN_PROGRESS, QUEUED},  # its last flush, then the queue, in one transaction
        {*FLUSHED_FIELDS, *QUEUED_AGAIN_FIELDS, "handed_back", *WAITING_FIELDS},
        ("checkpoints.FLUSH_SQL", "jobs.queue_again"),
        "its upstream server could not take it: it waits queued with the reason, "
        "its job sent again after a delay",
    ),
    "checkpoints.hand_back (waited too long)": _t(
        {IN_PROGRESS},
        {IN_PROGRESS, Status.FAILED.value},  # its last flush, then the end
        FLUSHED_FIELDS | CLOSED_FIELDS,
        ("checkpoints.FLUSH_SQL", "endings.finalize"),
        "a task that waited its model's limit for its upstream server fails, saying why",
    ),
    "upstream_waits.recovered": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        WAITING_FIELDS,
        ("upstream_waits.recovered",),
        "the upstream server answered a task that waited for it: the reason goes",
    ),
    "sweeper.sweep (lease expired, re-queued)": _t(
        {IN_PROGRESS},
        {QUEUED},
        QUEUED_AGAIN_FIELDS,
        ("jobs.queue_again",),
        "a lost worker's task goes back to its queue, keeping its attempt count and fair key",
    ),
    "sweeper.sweep (lease expired, ended)": _t(
        {IN_PROGRESS},
        {Status.CANCELLED.value, Status.FAILED.value},
        CLOSED_FIELDS,
        ("endings.finalize",),
        "a lost worker's task that was cancelled, past its attempts, or whose model is gone",
    ),
    "sweeper.sweep (message lost, re-sent)": _t(
        {QUEUED},
        {QUEUED},
        {"enqueued_at"},
        ("sweeper._resend", "sweeper.sweep"),
        "a queued task's job is sent again, or looked at again a period later",
    ),
    "sweeper.sweep (queued, model gone)": _t(
        {QUEUED},
        {Status.FAILED.value},
        CLOSED_FIELDS,
        ("endings.finalize",),
        "a queued task whose model was removed from the registry",
    ),
    "lifecycle.requeue_failed": _t(
        {Status.FAILED.value},
        {QUEUED},
        {
            "status",
            "error",
            "completed_at",
            "started_at",
            "worker",
            "lease_expires_at",
            "cancel_requested",
            "checkpoint",
            "enqueued_at",
            "last_event_id",
            *WAITING_FIELDS,
        },
        ("lifecycle.requeue_failed",),
        "an operator runs a failed task again (a new run, the attempt count goes on)",
    ),
    "retention.prune_events": _t(
        FINAL,
        FINAL,
        {"pruned_through"},
        ("retention.prune_events",),
        "an ended task's events are removed",
    ),
}


def move_response(task: Task) -> None:
    """Give the response of ``task`` (locked, its status just written) the
    status its task's status stands for (``RESPONSE_STATUS``), in the task's
    transaction: the one write of a response's status after its creation (a
    new response is in progress). The response's model is reached through
    ``Task.response``: its app is above this one and is not imported."""
    response_model = Task.response.field.related_model
    assert not isinstance(response_model, str)  # resolved once the apps are loaded
    response_model._default_manager.filter(pk=task.response_id).update(
        status=RESPONSE_STATUS[task.status]
    )


def writers() -> set[str]:
    """Every function or constant named as writing the task table."""
    return {writer for transition in TRANSITIONS.values() for writer in transition.writers}
