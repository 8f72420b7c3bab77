"""A task whose upstream server cannot take it now waits in its queue, saying why.

Why a module of its own: the own engine never turns a task away, so
waiting for another server is a part of a task's life that only upstream
models have (``[models.upstream]``). A worker whose request found the server
down, or answering 5xx or 429, hands the task back (``checkpoints.hand_back``
with a ``Waiting``): it goes back to queued with its checkpoint, the reason
and the time it began to wait, and its job is sent again after a delay
(half the time waited so far, 1 s at least, ``retry_seconds`` at most). Once
it has waited ``unavailable_timeout_seconds`` it fails with a problem that
says so. The first token of a later try clears the reason (``recovered``).
The reason is on the task's API object and in the admin.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from lmsp_core.errors import problem
from lmsp_core.status import Status

from .models import Task

MIN_RETRY_SECONDS = 1.0


@dataclass(frozen=True)
class Waiting:
    """Why a running task goes back to wait, and its model's limits."""

    reason: str  # the server's answer, or why it could not be reached
    timeout_seconds: float  # the longest wait, from the first refusal on
    retry_seconds: float  # the longest delay between two tries

    def delay(self, task: Task, now: datetime) -> float | None:
        """Seconds until the task is tried again, its reason and the start of
        its wait set on it (not saved); None, leaving it as it is, once it has
        waited ``timeout_seconds``."""
        since = task.waiting_since or now
        waited = (now - since).total_seconds()
        if waited >= self.timeout_seconds:
            return None
        task.waiting_reason, task.waiting_since = self.reason, since
        return min(max(waited / 2, MIN_RETRY_SECONDS), self.retry_seconds)

    def gave_up(self, task: Task, now: datetime) -> dict[str, Any]:
        """The error of a task that waited its model's whole limit."""
        waited = (now - (task.waiting_since or now)).total_seconds()
        return problem(
            "generation_failed",
            f"The upstream server of {task.model!r} could not take the request for "
            f"{waited:.0f} s (the model's limit is {self.timeout_seconds:.0f} s): {self.reason}",
            model=task.model,
        )


def recovered(task_id: str, attempt: int) -> None:
    """The server answered this attempt of a task that waited for it: the task
    no longer waits (nothing, if the attempt lost the task meanwhile)."""
    Task.objects.filter(id=task_id, attempt=attempt, status=Status.IN_PROGRESS).update(
        waiting_reason="", waiting_since=None
    )
