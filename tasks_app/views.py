"""Tasks endpoints (contract section 6)."""

from __future__ import annotations

from typing import Any, cast

from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.utils import timezone
from rest_framework.request import Request
from rest_framework.response import Response as DRFResponse
from rest_framework.views import APIView

from accounts_app.authentication import owner_of
from accounts_app.models import ApiToken
from accounts_app.services import bearer_credentials
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.http import check_method, csrf_free
from lmsp_core.ids import is_valid_id
from lmsp_core.validation import integer_param, validation_problem

from . import (
    budgets,
    event_reader,
    fairness,
    idempotency,
    selectors,
    services,
    stream_urls,
    task_types,
)
from .model_access import allowed_models
from .models import Task
from .serializers import TaskRequestSerializer
from .stream_access import StreamAccess
from .stream_admission import admit
from .streams import SSE_HEADERS, admitted_stream


def _task_object(task: Task) -> dict[str, Any]:
    return protocol.task_object(task, fairness.queue_position(task))


class TaskCollectionView(APIView):
    required_scopes = {"GET": "tasks:read", "POST": "tasks:write"}

    def post(self, request: Request) -> DRFResponse:
        key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
        serializer = TaskRequestSerializer(data=request.data)
        if not serializer.is_valid():
            raise validation_problem(serializer.errors)
        start = task_types.starter(serializer.validated_data["type"])
        allowed = allowed_models(cast(ApiToken, request.auth))
        body = serializer.validated_data["request"]
        task = start(owner_of(request), body, key, allowed, cast(ApiToken, request.auth).pk)
        return DRFResponse(
            _task_object(task),
            status=202,
            headers={"Location": f"/lmsp/v1/tasks/{task.id}", **budgets.headers_of(task)},
        )

    def get(self, request: Request) -> DRFResponse:
        query = request.query_params
        unknown = set(query) - {"limit", "after", "status"}
        if unknown:
            name = sorted(unknown)[0]
            raise ProblemError("invalid_request", f"Unknown query parameter {name!r}.", param=name)
        limit = integer_param(query.get("limit", "20"), "limit", 1, 100)
        status = query.get("status")
        if status is not None and status not in selectors.STATUSES:
            raise ProblemError(
                "invalid_request",
                f"status must be one of {', '.join(selectors.STATUSES)}.",
                param="status",
            )
        after = query.get("after")
        if after is not None and not is_valid_id(after, "task"):
            raise ProblemError(
                "invalid_request", "after must be a task id (task_ and a ULID).", param="after"
            )
        tasks, has_more = selectors.task_page(
            owner_of(request), limit=limit, after=after, status=status
        )
        next_cursor = tasks[-1].id if has_more else None
        data = [_task_object(task) for task in tasks]
        return DRFResponse(protocol.list_object(data, has_more=has_more, next_cursor=next_cursor))


class TaskDetailView(APIView):
    required_scopes = {"GET": "tasks:read"}

    def get(self, request: Request, task_id: str) -> DRFResponse:
        return DRFResponse(_task_object(selectors.owned_task(owner_of(request), task_id)))


class TaskCancelView(APIView):
    required_scopes = {"POST": "tasks:write"}

    def post(self, request: Request, task_id: str) -> DRFResponse:
        task = services.cancel_task(selectors.owned_task(owner_of(request), task_id))
        return DRFResponse(_task_object(task))


class TaskStreamUrlView(APIView):
    """A signed, short-lived URL of the task's event stream, for a web page
    (``tasks_app.stream_urls``)."""

    required_scopes = {"POST": "tasks:read"}

    def post(self, request: Request, task_id: str) -> DRFResponse:
        task = selectors.owned_task(owner_of(request), task_id)
        url, expires_at = stream_urls.issue(task.id, cast(ApiToken, request.auth), timezone.now())
        return DRFResponse(
            {
                "object": "stream_url",
                "task_id": task.id,
                "url": url,
                "expires_at": protocol.timestamp(expires_at),
            }
        )


def resume_point(request: HttpRequest) -> int:
    """``after`` wins over ``Last-Event-ID``; neither means from the start."""
    if "after" in request.GET:
        return integer_param(request.GET["after"], "after", 0)
    header = request.headers.get("Last-Event-ID")
    if header is not None:
        return integer_param(header.strip(), "Last-Event-ID", 0)
    return 0


async def _open_stream(request: HttpRequest, task_id: str) -> tuple[ApiToken, int, Task]:
    """Everything a new follower needs, in one query on the streams' pool (no
    thread, no new database session): its token (401/403), resume point
    (400) and task (404), refused in that order. An id that cannot be a
    task's is not sent to the database. The token is the bearer token of
    the ``Authorization`` header or, for a signed stream URL (an ``access``
    parameter, ``stream_urls``), the token it was issued to."""
    valid = is_valid_id(task_id, "task")
    signed = request.GET.get(stream_urls.PARAM)
    if signed is None:
        prefix, secret = bearer_credentials(request.headers.get("Authorization"))
        found, task = await event_reader.token_and_task(prefix, task_id if valid else None)
        token = await event_reader.judged_token(found, secret, "tasks:read")
    else:
        grant = stream_urls.grant(signed, task_id, timezone.now())
        found, task = await event_reader.granted_token_and_task(grant.token_id, grant.task_id)
        token = await event_reader.granted_token(found, grant.owner_id, "tasks:read")
    after = resume_point(request)
    if task is None:
        raise selectors.task_not_found(task_id)
    return token, after, task


@csrf_free
async def task_events(request: HttpRequest, task_id: str) -> HttpResponseBase:
    check_method(request, ("GET",))
    token, after, task = await _open_stream(request, task_id)
    if task.is_final and task.last_event_id <= after:
        return HttpResponse(status=204)
    if after > task.last_event_id:
        raise ProblemError(
            "invalid_request",
            f"The resume point {after} is past the task's last event ({task.last_event_id}).",
            param="after" if "after" in request.GET else "Last-Event-ID",
        )
    if after < task.pruned_through:
        raise ProblemError(
            "event_history_expired",
            f"Events up to {task.pruned_through} were removed by retention; "
            f"fetch the result from /lmsp/v1/tasks/{task.id}.",
            first_available_event_id=task.first_available_event_id,
            task_status=task.status,
            task_url=f"/lmsp/v1/tasks/{task.id}",
        )
    release = admit(token.pk, token.owner_id)
    return StreamingHttpResponse(
        admitted_stream(task.id, after, release, StreamAccess.of(token)),
        content_type="text/event-stream",
        headers=SSE_HEADERS,
    )
