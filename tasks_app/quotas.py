"""Per-owner quotas: generations at once, tasks waiting, output tokens a
minute (those sent in the last minute and the most the owner's queued and
running requests may still be sent, ``TokenUse``: fifty requests at once
cannot all be admitted under a quota one of them nearly fills); and the
token budgets per UTC day and month, whose counting (in-flight requests
charged their input and their whole output reservation until they end) is
told in ``tasks_app.budgets``.

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
from django.db.models import Sum
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


@dataclass(frozen=True)
class TokenUse:
    """What the output-token quota of a minute counts for a new request: the
    output of the owner's requests that ended in the last minute
    (``delivered``), the most its queued and running requests may still be
    sent (``reserved``: their ``cost``, their ``max_output_tokens``, until
    they end and their real output replaces it), and the most the new one
    may (``cost``)."""

    delivered: int
    reserved: int
    cost: int

    def admits(self, limit: int) -> bool:
        """Whether all of it fits ``limit``; a request larger than the whole
        quota counts as the quota (it runs alone, or never would)."""
        return self.delivered + self.reserved + min(self.cost, limit) <= limit


def token_use(owner_id: int, cost: int, now: datetime) -> TokenUse:
    """The owner's ``TokenUse`` at ``now`` for a request of ``cost``, read
    without its lock (the submit's statement counts the same under it)."""
    delivered = UsageRecord.objects.filter(
        owner_id=owner_id, completed_at__gte=now - TOKEN_WINDOW
    ).aggregate(total=Sum("output_tokens"))["total"]
    reserved = Task.objects.filter(owner_id=owner_id, status__in=budgets.IN_FLIGHT).aggregate(
        total=Sum("cost")
    )["total"]
    return TokenUse(delivered or 0, reserved or 0, cost)


def _token_retry_after(owner_id: int, limit: int, use: TokenUse, now: datetime) -> int:
    """Seconds until the output the owner was sent in the minute before ``now``
    leaves room for ``use``'s request beside its requests in flight, as far
    as the passing minute can make it; while the requests in flight alone
    leave none, the wait for one of them to end
    (``LMSP_QUOTA_RETRY_AFTER_SECONDS``)."""
    allowed = limit - use.reserved - min(use.cost, limit)
    if allowed < 0:
        return settings.LMSP_QUOTA_RETRY_AFTER_SECONDS
    delivered = list(
        UsageRecord.objects.filter(owner_id=owner_id, completed_at__gte=now - TOKEN_WINDOW)
        .order_by("completed_at")
        .values_list("completed_at", "output_tokens")
    )
    total = sum(tokens for _, tokens in delivered)
    for completed_at, tokens in delivered:
        if total <= allowed:
            break
        total -= tokens
        if total <= allowed:
            return math.ceil((cast(datetime, completed_at) + TOKEN_WINDOW - now).total_seconds())
    return 1  # room already (the figures moved since they were counted)


def refuse_if_over(owner_id: int, input_tokens: int) -> None:
    """Refuse (429) a request of ``input_tokens`` from an owner already past its
    queued-task or output-token quota or one of its token budgets, before the
    costly part of accepting it (compiling its grammar). A read without the
    owner's lock: the submit's own admission (``services.start_task``) still
    decides, this only spares the work. Its output is not known yet: it is
    counted as one token, so that only a request the submit would refuse
    whatever its size is refused here."""
    limits = limits_for(owner_id)
    waiting = 0
    if limits.max_queued:
        waiting = Task.objects.filter(owner_id=owner_id, status=Status.QUEUED).count()
    now = timezone.now()
    use = token_use(owner_id, 1, now) if limits.output_tokens_per_minute else TokenUse(0, 0, 1)
    admit(owner_id, limits, waiting, use, now)
    budgets.refuse_if_over(budgets.current(owner_id, now), input_tokens, now)


def admit(owner_id: int, limits: Limits, waiting: int, use: TokenUse, now: datetime) -> None:
    """Refuse a request past the owner's queued-task or output-token quota
    with 429. ``waiting`` and ``use`` are the owner's queued tasks and output
    tokens as the submit counted them under the owner's lock
    (``services.start_task``), ``now`` the submit's time, from which the last
    minute is counted."""
    if limits.max_queued and waiting >= limits.max_queued:
        raise _rate_limited(
            f"{waiting} of your tasks are already waiting (your quota is "
            f"{limits.max_queued}); try again once some have started.",
            settings.LMSP_QUOTA_RETRY_AFTER_SECONDS,
            "max_queued",
            limits.max_queued,
        )
    limit = limits.output_tokens_per_minute
    if limit and not use.admits(limit):
        raise _rate_limited(
            f"Your quota is {limit} output tokens a minute: you were sent {use.delivered} in "
            f"the last minute, your queued and running requests may still be sent "
            f"{use.reserved}, and this one up to {use.cost}; try again later.",
            _token_retry_after(owner_id, limit, use, now),
            "output_tokens_per_minute",
            limit,
        )
