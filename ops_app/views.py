"""``GET /metrics`` for Prometheus; ``GET /livez`` and ``GET /readyz`` (and
``/healthz``, the same as ``/readyz``) for load balancers, Kubernetes probes
and compose health checks: no token, and nothing in the answer but the
state of this process and of what it needs.

``/metrics`` needs a bearer token with the ``metrics:read`` or the
``metrics:operator`` scope: only the latter's scrape names owners and every
model (``collector.Audience``); the former's shows the models the token may
use, added up over owners. Each scrape builds a registry holding only
``LmspCollector``: no per-process numbers, so any web process gives the same
answer.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime

from django.db import DatabaseError, connection
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from accounts_app.models import ApiToken
from accounts_app.services import authenticate_bearer, require_scope
from generation.registry import declared_models
from lmsp_core.errors import ProblemError, problem_response
from lmsp_core.redis_client import REDIS_ERRORS, redis_client
from tasks_app.model_access import allowed_models

from . import upstream_health
from .collector import OPERATOR, Audience, LmspCollector

SCOPE = "metrics:read"
OPERATOR_SCOPE = "metrics:operator"


@require_GET
def metrics(request: HttpRequest) -> HttpResponse:
    try:
        token = authenticate_bearer(request.headers.get("Authorization"))
        if OPERATOR_SCOPE not in token.scopes:
            require_scope(token, SCOPE)
    except ProblemError as error:
        return problem_response(error)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(LmspCollector(_audience(token)))
    # The text format Prometheus asks for in Accept (OpenMetrics or 0.0.4).
    encode, content_type = choose_encoder(request.headers.get("Accept", ""))
    return HttpResponse(encode(registry), content_type=content_type)


def _audience(token: ApiToken) -> Audience:
    """An operator's scrape, or one without owners and with the token's models."""
    if OPERATOR_SCOPE in token.scopes:
        return OPERATOR
    return Audience(by_owner=False, models=allowed_models(token))


@require_GET
def livez(request: HttpRequest) -> HttpResponse:
    """200 while this web process answers at all (a liveness probe: restart
    it when this fails); it checks nothing else, so that an outage of
    PostgreSQL or Redis never gets every web process restarted."""
    return HttpResponse("ok\n", content_type="text/plain")


def _database_reachable() -> bool:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except DatabaseError:
        return False
    return True


def _redis_reachable() -> bool:
    try:
        return bool(redis_client().ping())
    except REDIS_ERRORS:
        return False


def _upstream_lines(redis_reachable: bool) -> list[str]:
    """One line per upstream model: its server as its workers last found it
    (as Redis holds it)."""
    models = sorted(model for model, spec in declared_models().items() if spec.upstream)
    try:
        found = upstream_health.read(models) if redis_reachable else {}
    except REDIS_ERRORS:
        found = {}
    now, lines = time.time(), []
    for model in models:
        health = found.get(model)
        if health is None:
            lines.append(f"upstream {model} unknown (no worker has probed it)")
            continue
        state = "ok" if health.reachable else "unreachable"
        since = datetime.fromtimestamp(health.since, UTC).isoformat(timespec="seconds")
        line = f"upstream {model} {state} since {since}"
        if not health.reachable:
            line += f": {health.reason}"
        if health.stale(now):
            line += f" (last checked {now - health.checked_at:.0f} s ago)"
        lines.append(line)
    return lines


@require_GET
def readyz(request: HttpRequest) -> HttpResponse:
    """200 when this web process reaches PostgreSQL and Redis (a readiness
    probe: send it requests), else 503; the body names each check's state,
    then each upstream model's server as its workers last found it. A server
    down does not make the service unready: its tasks wait queued, saying
    why (``tasks_app.upstream_waits``), and every other model still runs."""
    checks = {"database": _database_reachable(), "redis": _redis_reachable()}
    lines = [f"{name} {'ok' if ok else 'unreachable'}" for name, ok in checks.items()]
    body = "".join(f"{line}\n" for line in [*lines, *_upstream_lines(checks["redis"])])
    status = 200 if all(checks.values()) else 503
    return HttpResponse(body, status=status, content_type="text/plain")
