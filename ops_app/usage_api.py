"""``GET /lmsp/v1/usage``: what the caller's owner used of each model in a
period, by UTC day or month (scope ``usage:read``).

Why: an owner should learn their own use without an operator, and nothing of
anyone else's; ``/metrics`` is for operators. The numbers are the admin's
usage pages' for that owner (one source, ``usage_report``), filtered by the
same words (``from``, ``to``, ``preset``, ``model``, ``by``); a filter that
cannot be used (empty ones, and ``preset`` beside ``from`` or ``to``,
included) is a problem document naming it.
"""

from __future__ import annotations

from typing import Any

from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from accounts_app.authentication import owner_of
from lmsp_core.errors import ProblemError

from . import usage_report


class UsageView(APIView):
    required_scopes = {"GET": "usage:read"}

    def get(self, request: Request) -> Response:
        query = request.query_params
        unknown = sorted(set(query) - set(usage_report.FILTERS))
        if unknown:
            raise ProblemError(
                "invalid_request", f"Unknown query parameter {unknown[0]!r}.", param=unknown[0]
            )
        # Stricter than the admin's form, which sends empty fields for "any":
        # a parameter given is used, or refused.
        empty = sorted(name for name, value in query.items() if not value)
        if empty:
            raise ProblemError("invalid_request", f"{empty[0]} is empty.", param=empty[0])
        if "preset" in query and ("from" in query or "to" in query):
            raise ProblemError(
                "invalid_request",
                "preset names the period: give it or from and to.",
                param="preset",
            )
        try:
            filters = usage_report.filters_from(query.dict(), owner_of(request).pk)
        except usage_report.FilterError as error:
            raise ProblemError("invalid_request", str(error), param=error.name) from None
        usage = usage_report.report(filters)
        return Response(
            {
                "object": "usage",
                "from": filters.start.isoformat(),
                "to": filters.end.isoformat(),
                "by": filters.by,
                "model": filters.model,
                "data": [_figures(row, filters.by) for row in usage.rows],
                "total": _figures(usage.totals, None),
            }
        )


def _figures(row: usage_report.UsageRow, by: usage_report.Grain | None) -> dict[str, Any]:
    """A row's period (none for the total), model and figures."""
    figures = {figure: getattr(row, figure) for figure in usage_report.FIGURES}
    if by is None:
        return figures
    period = usage_report.cells(row, by)[0]
    return {"period": period, "model": row.model, **figures}
