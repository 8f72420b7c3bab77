"""Retention of everything a generation leaves behind, in the order that keeps
each step's rule simple: events (their readers then get 410), idempotency
keys past their TTL, the ``store: false`` responses nobody can fetch any
more (``records.discard_unneeded``), stored responses past
``LMSP_RESPONSE_RETENTION_DAYS`` (``records.forget_expired``), then tasks
past their retention."""

from __future__ import annotations

from tasks_app import idempotency, retention

from . import records


def prune_history(older_than: float | None = None) -> int:
    """Delete events of tasks that ended more than ``older_than`` seconds ago
    (default ``LMSP_EVENT_RETENTION_SECONDS``), then expired idempotency keys,
    unneeded responses, expired stored responses and expired tasks. Returns
    how many events were removed."""
    removed = retention.prune_events(older_than)
    idempotency.forget_expired()
    records.discard_unneeded()
    records.forget_expired()
    retention.forget_expired_tasks()
    return removed
