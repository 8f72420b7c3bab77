"""The event log: numbered events per task in PostgreSQL.

``EventLog.append``, the submit that creates a task with its first event
(``tasks_app.services.start_task``) and a worker's flush (one statement:
``tasks_app.checkpoints.record_progress_many``) are the only writers. Both
hold the task's row lock, so ids are assigned without gaps or repeats, and
the events, the task's ``last_event_id`` and whatever else changes on the
task commit together. Readers are woken after the commit (``announce``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
    def append(task: Task, events: list[tuple[str, dict[str, Any]]]) -> list[StoredEvent]:
        """Number and store ``events`` after the task's last one.

        ``task`` must be locked (``select_for_update``) in the current
        transaction; the caller saves it (``last_event_id`` included).
        """
        if not events:
            return []
        assert transaction.get_connection().in_atomic_block, "EventLog.append needs a transaction"
        stored, rows = EventLog.numbered(task, events)
        Event.objects.bulk_create(rows)
        EventLog.announce({task.id: stored})
        return stored

    @staticmethod
    def numbered(
        task: Task, events: list[tuple[str, dict[str, Any]]]
    ) -> tuple[list[StoredEvent], list[Event]]:
        """``events`` numbered after the task's last one, as sent and as rows
        to insert; ``task.last_event_id`` moves on to the last. A new task's
        rows are inserted by the statement that creates it
        (``services.start_task``), unannounced: nobody can follow it yet."""
        now = timezone.now()
        stored = [
            StoredEvent(task.last_event_id + offset, name, dumps(data))
            for offset, (name, data) in enumerate(events, start=1)
        ]
        task.last_event_id = stored[-1].id
        rows = [
            Event(task_id=task.id, seq=e.id, type=e.event, data=e.data, created_at=now)
            for e in stored
        ]
        return stored, rows

    @staticmethod
    def announce(stored: dict[str, list[StoredEvent]]) -> None:
        """Wake the readers of these tasks' events (by task id) once they are
        committed (at once outside a transaction), in one message."""
        batches = {
            task_id: [(e.id, e.event, e.data) for e in events] for task_id, events in stored.items()
        }
        transaction.on_commit(lambda: notify.publish(batches))
