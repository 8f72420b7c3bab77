"""The admin's own pages beside the model admins: the dashboard (with the
periodic jobs' health), the models, and usage by owner, model and day or
month (the whole service's, and one owner's), with its CSV.

Mounted under ``/admin/lmsp/`` in ``lmsp_project.urls``, each behind
``admin.site.admin_view`` (staff login, no caching, CSRF as elsewhere). The
usage pages also need a permission of their own, ``USAGE_PERMISSION`` (the
daily usage rows' view permission: a superuser has it, other staff users
when given it), since they show every owner's use; without it they answer
403.
"""

from __future__ import annotations

from urllib.parse import urlencode

from django.contrib import admin
from django.contrib.auth import get_user_model
from django.contrib.auth.decorators import permission_required
from django.contrib.auth.models import AbstractBaseUser
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path

from tasks_app import selectors

from . import charts, dashboard, jobs, usage_report

USAGE_PERMISSION = "tasks_app.view_dailyusage"
usage_pages = permission_required(USAGE_PERMISSION, raise_exception=True)


def dashboard_view(request: HttpRequest) -> HttpResponse:
    now, since = dashboard.since_window()
    usage = dashboard.usage_by_model(since)
    hourly = dashboard.hourly(now)
    depth = dashboard.queue_depth()
    labels = [hour.strftime("%H:00") for hour in hourly.hours]
    context = {
        **admin.site.each_context(request),
        "title": "Dashboard",
        "since": since,
        "usage": usage,
        "depth": depth,
        "failures": dashboard.recent_failures(since),
        "jobs": jobs.job_health_or_none(),
        "owners": selectors.queue_by_owner(since),
        "requests_chart": charts.stacked_columns(
            "Requests per hour and model, last 24 h", labels, hourly.requests
        ),
        "tokens_chart": charts.grouped_bars(
            "Tokens per model, last 24 h",
            ["input tokens", "output tokens"],
            [(u.model, [u.input_tokens, u.output_tokens]) for u in usage],
        ),
        "queue_chart": charts.grouped_bars(
            "Queue depth per model, now",
            ["queued", "in progress"],
            [(model, [d["queued"], d["in_progress"]]) for model, d in depth.items()],
        ),
        "failures_chart": charts.stacked_columns(
            "Failed responses per hour, last 24 h", labels, {"failed": hourly.failures}
        ),
    }
    return TemplateResponse(request, "admin/lmsp/dashboard.html", context)


def models_view(request: HttpRequest) -> HttpResponse:
    context = {
        **admin.site.each_context(request),
        "title": "Models",
        "rows": dashboard.model_rows(),
    }
    return TemplateResponse(request, "admin/lmsp/models.html", context)


def usage_view(request: HttpRequest) -> HttpResponse:
    return _usage_page(request, None)


def owner_usage_view(request: HttpRequest, owner_id: int) -> HttpResponse:
    return _usage_page(request, get_object_or_404(get_user_model(), pk=owner_id))


def _usage_page(request: HttpRequest, owner: AbstractBaseUser | None) -> HttpResponse:
    """The usage table, chart and totals for the query's filters
    (``usage_report.filters_from``), or their CSV with ``format=csv``."""
    owner_id = None if owner is None else owner.pk
    error: str | None = None
    try:
        filters = usage_report.filters_from(request.GET, owner_id)
    except ValueError as exc:  # shown on the page, with the default filters
        error, filters = str(exc), usage_report.filters_from({}, owner_id)
    usage = usage_report.report(filters)
    if request.GET.get("format") == "csv" and error is None:
        name = f"lmsp-usage-{owner or 'all'}-{filters.start}-{filters.end}.csv"
        answer = HttpResponse(content_type="text/csv; charset=utf-8")
        answer["Content-Disposition"] = f'attachment; filename="{name}"'
        usage_report.write_csv(usage, answer)
        return answer
    labels = [
        period.isoformat() if filters.by == "day" else period.strftime("%Y-%m")
        for period in usage.periods()
    ]
    title = f"Usage of {owner}" if owner is not None else "Usage"
    context = {
        **admin.site.each_context(request),
        "title": title,
        "owner": owner,
        "error": error,
        "filters": filters,
        "usage": usage,
        "models": usage_report.models_used(),
        "presets": [
            (urlencode({**filters.as_query(), "preset": key}), label)
            for key, label in usage_report.PRESETS.items()
        ],
        "filters_query": urlencode(filters.as_query()),
        "csv_query": urlencode({**filters.as_query(), "format": "csv"}),
        "chart": charts.stacked_columns(
            f"Input and output tokens per {filters.by} and model", labels, usage.tokens_by_model()
        ),
    }
    return TemplateResponse(request, "admin/lmsp/usage.html", context)


urlpatterns = [
    path("dashboard/", admin.site.admin_view(dashboard_view), name="lmsp-dashboard"),
    path("models/", admin.site.admin_view(models_view), name="lmsp-models"),
    path("usage/", admin.site.admin_view(usage_pages(usage_view)), name="lmsp-usage"),
    path(
        "usage/owner/<int:owner_id>/",
        admin.site.admin_view(usage_pages(owner_usage_view)),
        name="lmsp-owner-usage",
    ),
]
