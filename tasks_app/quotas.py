"""Per-owner quotas: generations at once, tasks waiting, output tokens a
minute; and the token budgets per UTC day and month, whose counting
(in-flight requests charged their input and their whole output reservation
until they end) is told in ``tasks_app.budgets``.

Counting is race-free because every submit of an owner (in the statement of
``tasks_app.services.start_task``) and every claim that checks the owner's
running limit (``lock_owner``; an owner without one is not counted) first
locks the owner's ``OwnerQuota`` row and counts inside that transaction: of
two requests at once, the second counts after the first has committed its
task. Past the queued or token quota a submit is refused with ``429
rate_limited`` and a ``Retry-After``; past the running quota nothing is
refused, the owner's tasks just wait in the queue until one of its
generations ends.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import cast

from django.conf import settings
from django.utils import timezone

from lmsp_core.errors import ProblemError
from lmsp_core.status import Status

from . import budgets
from .locking import locked_row
from .models import OwnerQuota, Task, UsageRecord

TOKEN_WINDOW = timedelta(seconds=60)


@dataclass(frozen=True)
class Limits:
    """An owner's effective quotas; 0 means no limit."""

    max_running: int
    max_queued: int
    output_tokens_per_minute: int


def lock_owner(owner_id: int) -> OwnerQuota:
    """The owner's quota row, created if missing, locked until the transaction ends."""
    return locked_row(OwnerQuota, owner_id=owner_id)


def limits_of(quota: OwnerQuota | None) -> Limits:
    def pick(value: int | None, default: int) -> int:
        return default if value is None else value

    return Limits(
        max_running=pick(quota.max_running if quota else None, settings.LMSP_QUOTA_MAX_RUNNING),
        max_queued=pick(quota.max_queued if quota else None, settings.LMSP_QUOTA_MAX_QUEUED),
        output_tokens_per_minute=pick(
            quota.output_tokens_per_minute if quota else None,
            settings.LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE,
        ),
    )


def limits_for(owner_id: int) -> Limits:
    return limits_of(OwnerQuota.objects.filter(owner_id=owner_id).first())


def running(owner_id: int) -> int:
    return Task.objects.filter(owner_id=owner_id, status=Status.IN_PROGRESS).count()


def may_start(owner_id: int, own_max_running: int | None) -> bool:
    """Whether one more of the owner's tasks may start now; ``own_max_running``
    is the owner's own limit as the claim read it with the task (None: the
    default). Without a limit nothing is counted or locked; with one, the
    owner's row is locked and the limit read again under the lock (call
    inside the claiming transaction)."""
    if own_max_running is None:
        own_max_running = settings.LMSP_QUOTA_MAX_RUNNING
    if own_max_running == 0:
        return True
    limit = limits_of(lock_owner(owner_id)).max_running
    return limit == 0 or running(owner_id) < limit


def _rate_limited(detail: str, retry_after: int, quota: str, limit: int) -> ProblemError:
    return ProblemError(
        "rate_limited",
        detail,
        headers={"Retry-After": str(max(1, retry_after))},
        quota=quota,
        limit=limit,
    )


def _token_retry_after(owner_id: int, limit: int, now: datetime) -> int | None:
    """Seconds until the owner's tokens of the minute before ``now`` fall below
    ``limit``; None while they are below it already."""
    delivered = list(
        UsageRecord.objects.filter(owner_id=owner_id, completed_at__gte=now - TOKEN_WINDOW)
        .order_by("completed_at")
        .values_list("completed_at", "output_tokens")
    )
    total = sum(tokens for _, tokens in delivered)
    for completed_at, tokens in delivered:
        if total < limit:
            break
        total -= tokens
        leaves_in = (cast(datetime, completed_at) + TOKEN_WINDOW - now).total_seconds()
        if total < limit:
            return math.ceil(leaves_in)
    return None if total < limit else math.ceil(TOKEN_WINDOW.total_seconds())


def refuse_if_over(owner_id: int, input_tokens: int) -> None:
    """Refuse (429) a request of ``input_tokens`` from an owner already past its
    queued-task or output-token quota or one of its token budgets, before the
    costly part of accepting it (compiling its grammar). A read without the
    owner's lock: the submit's own admission (``services.start_task``) still
    decides, this only spares the work."""
    limits = limits_for(owner_id)
    waiting = 0
    if limits.max_queued:
        waiting = Task.objects.filter(owner_id=owner_id, status=Status.QUEUED).count()
    now = timezone.now()
    admit(owner_id, limits, waiting, now)
    budgets.refuse_if_over(budgets.current(owner_id, now), input_tokens, now)


def admit(owner_id: int, limits: Limits, waiting: int, now: datetime) -> None:
    """Refuse a request past the owner's queued-task or output-token quota
    with 429. ``waiting`` is the owner's queued tasks as the submit counted
    them under the owner's lock (``services.start_task``), ``now`` the
    submit's time, from which the last minute is counted: the output tokens
    of that minute only grow, so a submit refused for them is refused here
    too."""
    if limits.max_queued and waiting >= limits.max_queued:
        raise _rate_limited(
            f"{waiting} of your tasks are already waiting (your quota is "
            f"{limits.max_queued}); try again once some have started.",
            settings.LMSP_QUOTA_RETRY_AFTER_SECONDS,
            "max_queued",
            limits.max_queued,
        )
    if limits.output_tokens_per_minute:
        retry_after = _token_retry_after(owner_id, limits.output_tokens_per_minute, now)
        if retry_after is not None:
            raise _rate_limited(
                f"You were sent {limits.output_tokens_per_minute} or more output tokens in "
                "the last minute (your quota); try again later.",
                retry_after,
                "output_tokens_per_minute",
                limits.output_tokens_per_minute,
            )
