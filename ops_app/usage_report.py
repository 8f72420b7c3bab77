"""What each owner used of each model in a period, by day or month: the one
source of the numbers on the usage pages, in their CSV and in
``manage.py lmsp_usage``, read from ``DailyUsage`` (kept beyond retention;
a request is in it once it has ended, on the UTC day it was accepted).

The filters come from a page's query string, the command's options or the
owners' ``GET /lmsp/v1/usage``, in the same words (``from``, ``to``,
``preset``, ``model``, ``by``), and are read by one function,
``filters_from``, which bounds a period to ``MAX_DAYS`` so that no request
builds more than a year of rows. The CSV's cells are written so that a
spreadsheet shows them as text, never runs them (``csv_cell``).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import date, timedelta
from typing import Literal, Protocol

from django.db.models import F, Sum
from django.db.models.functions import TruncMonth
from django.utils import timezone

from tasks_app.models import DailyUsage

Grain = Literal["day", "month"]
FIGURES = ("requests", "input_tokens", "output_tokens", "cached_tokens", "worker_seconds")
COLUMNS = ("period", "owner", "model", *FIGURES)
PRESETS = {
    "this_month": "This month",
    "last_month": "Last month",
    "last_30_days": "Last 30 days",
}
FILTERS = ("from", "to", "preset", "model", "by")
MAX_DAYS = 366
ISO_DATE = re.compile(r"[0-9]{4}-[0-9]{2}-[0-9]{2}")
# What starts a formula (or hides one) in Excel, LibreOffice and Google Sheets (OWASP).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


class FilterError(ValueError):
    """A filter that cannot be used, and the word it came in (``FILTERS``)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


class TextOut(Protocol):
    """Where a report is written: a file, an HTTP response, a command's stdout."""

    def write(self, text: str, /) -> object: ...


@dataclass(frozen=True)
class UsageFilters:
    """A period of UTC days, both ends included, and what else narrows it."""

    start: date
    end: date
    by: Grain = "day"
    model: str | None = None
    owner_id: int | None = None

    def as_query(self) -> dict[str, str]:
        """The query string that asks for these filters (the owner is in a page's path)."""
        query = {"from": self.start.isoformat(), "to": self.end.isoformat(), "by": self.by}
        return query | ({"model": self.model} if self.model else {})


@dataclass(frozen=True)
class UsageRow:
    period: date  # the day, or the first day of the month
    owner_id: int
    owner: str
    model: str
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    worker_seconds: float = 0.0


@dataclass(frozen=True)
class UsageReport:
    filters: UsageFilters
    rows: list[UsageRow]  # by period, owner, model
    totals: UsageRow  # every row added up (its period, owner and model are empty)

    def periods(self) -> list[date]:
        """Every day (or month) of the period, with usage or not."""
        start, end = self.filters.start, self.filters.end
        if self.filters.by == "day":
            return [start + timedelta(days=n) for n in range((end - start).days + 1)]
        months, month = [], start.replace(day=1)
        while month <= end:
            months.append(month)
            month = (month + timedelta(days=31)).replace(day=1)
        return months

    def tokens_by_model(self) -> dict[str, list[int]]:
        """Input and output tokens of each period, per model (for a chart)."""
        index = {period: i for i, period in enumerate(self.periods())}
        series: dict[str, list[int]] = {}
        for row in self.rows:
            values = series.setdefault(row.model, [0] * len(index))
            values[index[row.period]] += row.input_tokens + row.output_tokens
        return dict(sorted(series.items()))


def preset_period(preset: str, today: date) -> tuple[date, date]:
    first = today.replace(day=1)
    if preset == "this_month":
        return first, today
    if preset == "last_month":
        end = first - timedelta(days=1)
        return end.replace(day=1), end
    if preset == "last_30_days":
        return today - timedelta(days=29), today
    raise FilterError("preset", f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")


def filters_from(
    query: Mapping[str, str | None], owner_id: int | None = None, today: date | None = None
) -> UsageFilters:
    """Filters from a query string or the command's options: ``preset`` (see
    ``PRESETS``), else ``from`` and ``to`` (ISO dates; by default this
    month so far; at most ``MAX_DAYS`` days), ``model`` and ``by`` (``day``
    or ``month``). Raises FilterError naming what is wrong."""
    today = today or timezone.now().date()
    start, end = preset_period(query.get("preset") or "this_month", today)
    if not query.get("preset"):
        start, end = _date(query, "from", start), _date(query, "to", end)
    if start > end:
        raise FilterError("from", f"from ({start}) is after to ({end})")
    days = (end - start).days + 1
    if days > MAX_DAYS:
        raise FilterError(
            "to", f"a period is at most {MAX_DAYS} days; {start} to {end} is {days} days"
        )
    by = query.get("by") or "day"
    if by not in ("day", "month"):
        raise FilterError("by", f"by must be day or month, not {by!r}")
    grain: Grain = "month" if by == "month" else "day"
    return UsageFilters(start, end, grain, query.get("model") or None, owner_id)


def _date(query: Mapping[str, str | None], name: str, default: date) -> date:
    value = query.get(name)
    if not value:
        return default
    try:
        if not ISO_DATE.fullmatch(value):  # fromisoformat takes 20261130 and weeks too
            raise ValueError(value)
        return date.fromisoformat(value)
    except ValueError:
        message = f"{name} must be a date such as 2026-11-30, not {value!r}"
        raise FilterError(name, message) from None


def report(filters: UsageFilters) -> UsageReport:
    days = DailyUsage.objects.filter(day__range=(filters.start, filters.end))
    if filters.model:
        days = days.filter(model=filters.model)
    if filters.owner_id is not None:
        days = days.filter(owner_id=filters.owner_id)
    period = F("day") if filters.by == "day" else TruncMonth("day")
    grouped = (
        days.annotate(period=period, owner_name=F("owner__username"))
        .values("period", "owner_id", "owner_name", "model")
        .annotate(**{figure: Sum(figure) for figure in FIGURES})
        .order_by("period", "owner_name", "model")
    )
    rows = [
        UsageRow(
            period=row["period"],
            owner_id=row["owner_id"],
            owner=row["owner_name"],
            model=row["model"],
            **{figure: row[figure] for figure in FIGURES},
        )
        for row in grouped
    ]
    return UsageReport(filters, rows, _total(rows))


def _total(rows: Iterable[UsageRow]) -> UsageRow:
    total = UsageRow(period=date.min, owner_id=0, owner="", model="")
    for row in rows:
        total = replace(total, **{f: getattr(total, f) + getattr(row, f) for f in FIGURES})
    return total


def models_used() -> list[str]:
    """The models anyone has used, for the filter's choices."""
    return list(DailyUsage.objects.order_by("model").values_list("model", flat=True).distinct())


def cells(row: UsageRow, by: Grain) -> list[str]:
    """One row as the CSV and the command write it."""
    period = row.period.isoformat() if by == "day" else row.period.strftime("%Y-%m")
    figures = [str(getattr(row, f)) for f in FIGURES[:-1]] + [f"{row.worker_seconds:.3f}"]
    return [period, row.owner, row.model, *figures]


def csv_cell(text: str) -> str:
    """``text`` as a spreadsheet shows it and never runs it: one that would
    start a formula gets a leading apostrophe."""
    return "'" + text if text.startswith(FORMULA_STARTS) else text


def write_csv(usage: UsageReport, out: TextOut) -> None:
    """The report's rows under a header (no total row: the columns add up to it),
    lines ended as RFC 4180 says, so that a cell holding CR or LF is quoted."""
    writer = csv.writer(out, lineterminator="\r\n")
    writer.writerow(COLUMNS)
    writer.writerows(map(csv_cell, cells(row, usage.filters.by)) for row in usage.rows)


def write_table(usage: UsageReport, out: TextOut) -> None:
    """The report's rows and their total as a plain text table."""
    body = [cells(row, usage.filters.by) for row in usage.rows]
    total = ["total", "", "", *cells(usage.totals, usage.filters.by)[3:]]
    lines = [list(COLUMNS), *body, total]
    widths = [max(len(line[i]) for line in lines) for i in range(len(COLUMNS))]
    for line in lines:
        text = [
            cell.ljust(width) if i < 3 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        out.write("  ".join(text).rstrip() + "\n")
