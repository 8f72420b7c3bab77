"""Reads of tasks."""

from __future__ import annotations

from django.contrib.auth.base_user import AbstractBaseUser
from django.db.models import QuerySet

from lmsp_core.errors import ProblemError
from lmsp_core.ids import is_valid_id
from lmsp_core.status import Status

from .models import Task, TaskKind


def owned_task(owner: AbstractBaseUser, task_id: str) -> Task:
    """One of the owner's tasks; any other id is 404, existing or not (an id
    that cannot be one, NUL included, never reaches the database)."""
    task = None
    if is_valid_id(task_id, "task"):
        task = (
            Task.objects.select_related("response")
            .filter(id=task_id, owner=owner, kind=TaskKind.TASK)
            .first()
        )
    if task is None:
        shown = task_id if len(task_id) <= 64 else task_id[:64] + "..."
        raise ProblemError("task_not_found", f"No task with id {shown!r}.", param="task_id")
    return task


def task_page(
    owner: AbstractBaseUser,
    *,
    limit: int,
    after: str | None,
    status: str | None,  # noqa: ANN001
) -> tuple[list[Task], bool]:
    tasks: QuerySet[Task] = Task.objects.select_related("response").filter(
        owner=owner, kind=TaskKind.TASK
    )
    if status is not None:
        tasks = tasks.filter(status=status)
    if after is not None:
        tasks = tasks.filter(id__lt=after)
    page = list(tasks.order_by("-id")[: limit + 1])
    return page[:limit], len(page) > limit


STATUSES = [choice.value for choice in Status]
