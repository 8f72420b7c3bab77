"""``GET /metrics`` for Prometheus, and ``GET /healthz`` for container checks.

``/metrics`` needs a bearer token with the ``metrics:read`` scope. Each
scrape builds a registry holding only ``LmspCollector``: no per-process
numbers, so any web process gives the same answer.
"""

from __future__ import annotations

from django.db import connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from accounts_app.services import authenticate_bearer, require_scope
from lmsp_core.errors import ProblemError, problem_response

from .collector import LmspCollector

SCOPE = "metrics:read"


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    try:
        token = authenticate_bearer(request.headers.get("Authorization"))
        require_scope(token, SCOPE)
    except ProblemError as error:
        return problem_response(error)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LmspCollector())
    # The text format Prometheus asks for in Accept (OpenMetrics or 0.0.4).
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encode(registry), content_type=content_type)


@require_GET
def healthz(request: HttpRequest) -> HttpResponse:
    """200 when this web process can reach PostgreSQL (no token: for health checks)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return HttpResponse("ok\n", content_type="text/plain")
