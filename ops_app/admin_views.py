"""The admin's own pages beside the model admins: the dashboard (with the
periodic jobs' health) and the models.

Mounted under ``/admin/lmsp/`` in ``lmsp_project.urls``, each behind
``admin.site.admin_view`` (staff login, no caching, CSRF as elsewhere).
"""

from __future__ import annotations

from django.contrib import admin
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path

from tasks_app import selectors

from . import charts, dashboard, jobs


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


urlpatterns = [
    path("dashboard/", admin.site.admin_view(dashboard_view), name="lmsp-dashboard"),
    path("models/", admin.site.admin_view(models_view), name="lmsp-models"),
]
