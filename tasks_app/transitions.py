"""The task lifecycle as a state machine: every change of a task row, stated.

A task's row is written by a handful of SQL statements spread over
``services`` (the submit's one statement), ``lifecycle`` (claims, flushes,
the end, cancels, sweeps, an operator's re-queue) and ``retention``. This
table says, for each change, from which statuses to which it goes, which
columns it may set, and which code writes it (``writers``: the functions, or
the SQL constants, whose statements touch the row). ``tests/test_transitions.py``
runs every transition against PostgreSQL with a trigger that records each
change of the row, checks it against its line here, and checks that the
code's writers of the task table are exactly the ones named here: a new
path that changes a task needs a line.
"""

from __future__ import annotations

from dataclasses import dataclass

from lmsp_core.status import FINAL_STATUSES, Status

QUEUED, IN_PROGRESS = Status.QUEUED.value, Status.IN_PROGRESS.value
FINAL = frozenset(str(status) for status in FINAL_STATUSES)
# What closing a task writes (``lifecycle._finalize``): its last events, the
# status, the error, the end time; the lease and the checkpoint go.
CLOSED_FIELDS = frozenset(
    {"status", "error", "completed_at", "lease_expires_at", "checkpoint", "last_event_id"}
)

# What a flush writes (``lifecycle.FLUSH_SQL``), and what putting a running
# task back in its queue does (``lifecycle._queue_again``).
FLUSHED_FIELDS = frozenset({"last_event_id", "checkpoint", "lease_expires_at"})
QUEUED_AGAIN_FIELDS = frozenset({"status", "worker", "lease_expires_at", "enqueued_at"})


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
    "lifecycle.claim": _t(
        {QUEUED},
        {IN_PROGRESS},
        {"status", "attempt", "worker", "started_at", "lease_expires_at"},
        ("lifecycle._claim_sql", "lifecycle._claim_counting_running"),
        "a worker takes the fairest queued task: the next attempt, a lease",
    ),
    "lifecycle.claim (may no longer run)": _t(
        {QUEUED},
        {Status.FAILED.value},
        CLOSED_FIELDS,
        ("lifecycle._finalize",),
        "a queued task whose token, owner or model may no longer be used ends, never run",
    ),
    "lifecycle.record_progress": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        FLUSHED_FIELDS,
        ("lifecycle.FLUSH_SQL",),
        "a flush of the current attempt: events, checkpoint, lease renewed",
    ),
    "lifecycle.renew_lease": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        {"lease_expires_at"},
        ("lifecycle.renew_lease",),
        "the current attempt keeps its lease",
    ),
    "lifecycle.finish": _t(
        {IN_PROGRESS},
        FINAL,
        CLOSED_FIELDS,
        ("lifecycle._finalize",),
        "the current attempt writes its last events and the outcome",
    ),
    "lifecycle.request_cancel (queued)": _t(
        {QUEUED},
        {Status.CANCELLED.value},
        CLOSED_FIELDS,
        ("lifecycle._finalize",),
        "a queued task ends at once",
    ),
    "lifecycle.request_cancel (running)": _t(
        {IN_PROGRESS},
        {IN_PROGRESS},
        {"cancel_requested"},
        ("lifecycle.request_cancel",),
        "a running task is asked to stop; its worker ends it",
    ),
    "lifecycle.hand_back": _t(
        {IN_PROGRESS},
        {IN_PROGRESS, QUEUED},  # its last flush, then the queue, in one transaction
        {*FLUSHED_FIELDS, *QUEUED_AGAIN_FIELDS, "handed_back"},
        ("lifecycle.FLUSH_SQL", "lifecycle._queue_again"),
        "a worker gives its running task back (its engine needed the memory, or it drains): "
        "its last flush, then the queue at once, its fair key kept, no attempt counted lost",
    ),
    "lifecycle.hand_back (cancelled meanwhile)": _t(
        {IN_PROGRESS},
        {IN_PROGRESS, Status.CANCELLED.value},  # its last flush, then the end
        FLUSHED_FIELDS | CLOSED_FIELDS,
        ("lifecycle.FLUSH_SQL", "lifecycle._finalize"),
        "a task handed back after a cancel was asked ends cancelled instead",
    ),
    "lifecycle.sweep (lease expired, re-queued)": _t(
        {IN_PROGRESS},
        {QUEUED},
        QUEUED_AGAIN_FIELDS,
        ("lifecycle._queue_again",),
        "a lost worker's task goes back to its queue, keeping its attempt count and fair key",
    ),
    "lifecycle.sweep (lease expired, ended)": _t(
        {IN_PROGRESS},
        {Status.CANCELLED.value, Status.FAILED.value},
        CLOSED_FIELDS,
        ("lifecycle._finalize",),
        "a lost worker's task that was cancelled, past its attempts, or whose model is gone",
    ),
    "lifecycle.sweep (message lost, re-sent)": _t(
        {QUEUED},
        {QUEUED},
        {"enqueued_at"},
        ("lifecycle._resend", "lifecycle.sweep"),
        "a queued task's job is sent again, or looked at again a period later",
    ),
    "lifecycle.sweep (queued, model gone)": _t(
        {QUEUED},
        {Status.FAILED.value},
        CLOSED_FIELDS,
        ("lifecycle._finalize",),
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


def writers() -> set[str]:
    """Every function or constant named as writing the task table."""
    return {writer for transition in TRANSITIONS.values() for writer in transition.writers}
