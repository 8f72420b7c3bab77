"""An owner's token budgets: input and output tokens per UTC day and per UTC
calendar month (``OwnerQuota.*_tokens_per_day`` / ``_per_month``; empty: no
budget, the default).

What a period has used: the owner's ``DailyUsage`` rows of the period (the
requests that ended, counted on the UTC day they were accepted) plus its
requests still queued or running that were accepted in the period: their
input tokens (known when they are accepted) and, for output, their whole
reservation, the task's ``cost`` (its ``max_output_tokens``), until they end
and their real output replaces it in the same transaction
(``tasks_app.endings``). So in-flight generations can never together pass
an output budget they were admitted under by more than one request's
reservation, and what is left only grows when one ends short of its limit.

A request is refused (``429 rate_limited``, the problem naming the ``quota``
and its ``limit``) when its input tokens would take an input budget past its
limit, or when an output budget is used up (reservations included); its
``Retry-After`` is the wait until the period that frees it begins (the next
UTC midnight, the first of the next month; the later one when several
refuse). The check is part of the submit's one statement, under the owner's
lock (``tasks_app.services.SUBMIT_SQL`` embeds ``USED_SQL``): of two
requests at once, the second counts the first's reservation.

An accepted request is told what is left after it (its input and its
reservation taken) in the ``LMSP-Budget-Remaining`` header, one
``<input|output>-tokens-<day|month>=N`` per budget that is set. A replay of
an idempotent request is not charged again; it is told what is left now.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from typing import Any

from django.db import connection
from django.utils import timezone

from lmsp_core.errors import ProblemError
from lmsp_core.status import Status

from .models import Task

HEADER = "LMSP-Budget-Remaining"
# The statuses of a request whose output is still its reservation.
IN_FLIGHT = [Status.QUEUED.value, Status.IN_PROGRESS.value]

# (OwnerQuota's field, which tokens, which period), in the header's order.
BUDGETS = (
    ("input_tokens_per_day", "input", "day"),
    ("output_tokens_per_day", "output", "day"),
    ("input_tokens_per_month", "input", "month"),
    ("output_tokens_per_month", "output", "month"),
)
BUDGET_COLUMNS = ", ".join(field for field, _, _ in BUDGETS)

# The owner's use of each budget's period (columns input_day, output_day,
# input_month, output_month), for a statement whose ``limits`` CTE has the
# budget columns of the owner's quota row: nothing is read when none is set.
USED_SQL = f"""
SELECT coalesce(sum(input_tokens) FILTER (WHERE today), 0)::bigint AS input_day,
       coalesce(sum(output_tokens) FILTER (WHERE today), 0)::bigint AS output_day,
       coalesce(sum(input_tokens), 0)::bigint AS input_month,
       coalesce(sum(output_tokens), 0)::bigint AS output_month
  FROM (
    SELECT day >= %(today)s AS today, input_tokens, output_tokens
      FROM tasks_app_dailyusage
     WHERE owner_id = %(owner)s AND day >= %(month_first)s
    UNION ALL
    SELECT t.created_at >= %(today_start)s, u.input_tokens, t.cost
      FROM tasks_app_task t JOIN tasks_app_usagerecord u ON u.response_id = t.response_id
     WHERE t.owner_id = %(owner)s AND t.status = ANY(%(in_flight)s)
       AND t.created_at >= %(month_start)s
  ) AS charged
 WHERE EXISTS (SELECT FROM limits WHERE num_nonnulls({BUDGET_COLUMNS}) > 0)
"""

# What a submit's admission adds (``%(input_tokens)s``: the request's).
ADMITS_SQL = """
       AND (input_tokens_per_day IS NULL
            OR input_day + %(input_tokens)s <= input_tokens_per_day)
       AND (input_tokens_per_month IS NULL
            OR input_month + %(input_tokens)s <= input_tokens_per_month)
       AND (output_tokens_per_day IS NULL OR output_day < output_tokens_per_day)
       AND (output_tokens_per_month IS NULL OR output_month < output_tokens_per_month)"""

_NOW_SQL = f"""
WITH limits AS (SELECT {BUDGET_COLUMNS} FROM tasks_app_ownerquota WHERE owner_id = %(owner)s)
SELECT {BUDGET_COLUMNS}, used.* FROM limits, ({USED_SQL}) AS used
"""


@dataclass(frozen=True)
class Budget:
    """One budget that is set, and what its period has used so far."""

    field: str
    tokens: str  # "input" or "output"
    period: str  # "day" or "month"
    limit: int
    used: int

    def refuses(self, input_tokens: int) -> bool:
        if self.tokens == "input":
            return self.used + input_tokens > self.limit
        return self.used >= self.limit

    def left_after(self, input_tokens: int, reserved_output: int) -> int:
        spent = input_tokens if self.tokens == "input" else reserved_output
        return max(0, self.limit - self.used - spent)


def sql_params(owner_id: int, now: datetime) -> dict[str, Any]:
    """The parameters of ``USED_SQL`` for a request at ``now``."""
    today = now.astimezone(UTC).date()
    month_first = today.replace(day=1)
    return {
        "owner": owner_id,
        "today": today,
        "today_start": _midnight(today),
        "month_first": month_first,
        "month_start": _midnight(month_first),
        "in_flight": IN_FLIGHT,
    }


def _midnight(day: date) -> datetime:
    return datetime.combine(day, time(), tzinfo=UTC)


def period_end(period: str, now: datetime) -> datetime:
    """When the next period begins: the next UTC midnight, or the first of the
    next month."""
    today = now.astimezone(UTC).date()
    if period == "day":
        return _midnight(today + timedelta(days=1))
    following = (today.replace(day=28) + timedelta(days=4)).replace(day=1)
    return _midnight(following)


def budgets_of(limits: Sequence[int | None], used: Sequence[int]) -> list[Budget]:
    """The budgets that are set, from the columns of ``BUDGETS`` (``limits``)
    and of ``USED_SQL`` (``used``, in the same order)."""
    return [
        Budget(field, tokens, period, limit, int(spent))
        for (field, tokens, period), limit, spent in zip(BUDGETS, limits, used, strict=True)
        if limit is not None
    ]


def current(owner_id: int, now: datetime) -> list[Budget]:
    """The owner's budgets and their use at ``now``, read without its lock
    (what the admin shows, and what a replay is told)."""
    with connection.cursor() as cursor:
        cursor.execute(_NOW_SQL, sql_params(owner_id, now))
        row = cursor.fetchone()
    if row is None:  # no quota row: no budget
        return []
    return budgets_of(row[: len(BUDGETS)], row[len(BUDGETS) :])


def refuse_if_over(budgets: list[Budget], input_tokens: int, now: datetime) -> None:
    """429 when one of ``budgets`` refuses a request of ``input_tokens``."""
    refusing = [budget for budget in budgets if budget.refuses(input_tokens)]
    if not refusing:
        return
    reopens = max(period_end(budget.period, now) for budget in refusing)
    first = refusing[0]
    what = (
        f"this request's {input_tokens} input tokens would pass"
        if first.tokens == "input"
        else "you have used up"
    )
    raise ProblemError(
        "rate_limited",
        f"{what.capitalize()} your {first.tokens} token budget of the UTC {first.period} "
        f"({first.used} of {first.limit} used or reserved); try again when the next "
        f"{first.period} begins.",
        headers={"Retry-After": str(max(1, math.ceil((reopens - now).total_seconds())))},
        quota=first.field,
        limit=first.limit,
    )


def header_value(budgets: list[Budget], input_tokens: int, reserved_output: int) -> str:
    """``LMSP-Budget-Remaining``'s value; empty when no budget is set."""
    return ", ".join(
        f"{budget.tokens}-tokens-{budget.period}={budget.left_after(input_tokens, reserved_output)}"
        for budget in budgets
    )


def remaining_now(owner_id: int) -> str:
    """``LMSP-Budget-Remaining``'s value for a replay: what is left now."""
    return header_value(current(owner_id, timezone.now()), 0, 0)


def headers_of(task: Task) -> dict[str, str]:
    """The header an accepted request's answer carries (none without budgets):
    what was left once it was admitted (``services.start_task``), or for a
    replay, when it was replayed (``remaining_now``)."""
    return {HEADER: task.budget_remaining} if task.budget_remaining else {}
