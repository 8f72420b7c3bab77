"""The event log: numbered events per task in PostgreSQL.

``EventLog.append`` and a worker's flush (one statement:
``tasks_app.lifecycle.record_progress_many``) are the only writers. Both
hold the task's row lock, so ids are assigned without gaps or repeats, and
the events, the task's ``last_event_id`` and whatever else changes on the
task commit together. Readers are woken after the commit (``announce``).
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django.utils import timezone

from lmsp_core.protocol import dumps

from . import notify
from .models import Event, Task


@dataclass(frozen=True)
class StoredEvent:
    id: int
    event: str
    data: str  # compact JSON, as sent


class EventLog:
    @staticmethod
    def append(
        task: Task, events: list[tuple[str, dict]], *, new_task: bool = False
    ) -> list[StoredEvent]:
        """Number and store ``events`` after the task's last one.

        ``task`` must be locked (``select_for_update``) in the current
        transaction; the caller saves it (``last_event_id`` included).
        ``new_task``: the task is created in this transaction, so no reader
        can follow it yet and nothing is published (a Redis round trip on
        every submit, and a message every web process would read for nobody).
        """
        if not events:
            return []
        assert transaction.get_connection().in_atomic_block, "EventLog.append needs a transaction"
        now = timezone.now()
        stored = [
            StoredEvent(task.last_event_id + offset, name, dumps(data))
            for offset, (name, data) in enumerate(events, start=1)
        ]
        Event.objects.bulk_create(
            Event(task_id=task.id, seq=e.id, type=e.event, data=e.data, created_at=now)
            for e in stored
        )
        task.last_event_id = stored[-1].id
        if not new_task:
            EventLog.announce(task.id, stored)
        return stored

    @staticmethod
    def announce(task_id: str, stored: list[StoredEvent]) -> None:
        """Wake the task's readers once the events are committed (at once
        outside a transaction)."""
        transaction.on_commit(
            lambda: notify.publish(task_id, [(e.id, e.event, e.data) for e in stored])
        )
