"""Models and responses endpoints (section 6.1-6.3, contract sections 4-5)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any, cast

from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from rest_framework.request import Request
from rest_framework.response import Response as DRFResponse
from rest_framework.views import APIView

from accounts_app.authentication import owner_of
from accounts_app.models import ApiToken
from generation.registry import get_model, listed_models
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.http import check_method, cpu_call, csrf_free, db_call, json_body
from tasks_app import budgets, event_reader, idempotency
from tasks_app.event_log import StoredEvent
from tasks_app.model_access import allowed_models
from tasks_app.models import Task, TaskKind
from tasks_app.stream_access import StreamAccess
from tasks_app.stream_admission import admitted
from tasks_app.streams import SSE_HEADERS, lmsp_frame

from . import direct, records
from .selectors import erasable_responses, stored_response
from .serializers import validate_response_request
from .submit import submit


class ModelListView(APIView):
    required_scopes = {"GET": "models:read"}

    def get(self, request: Request) -> DRFResponse:
        allowed = allowed_models(cast(ApiToken, request.auth))
        models = [protocol.model_object(spec) for spec in listed_models(allowed)]
        return DRFResponse(protocol.list_object(models))


class ModelDetailView(APIView):
    required_scopes = {"GET": "models:read"}

    def get(self, request: Request, model_id: str) -> DRFResponse:
        allowed = allowed_models(cast(ApiToken, request.auth))
        spec = get_model(model_id, param="model_id", allowed=allowed)
        return DRFResponse(protocol.model_object(spec))


class ResponseDetailView(APIView):
    required_scopes = {"GET": "responses:read", "DELETE": "responses:write"}

    def get(self, request: Request, response_id: str) -> DRFResponse:
        response = stored_response(owner_of(request), response_id, param="response_id")
        return DRFResponse(protocol.response_object(response))

    def delete(self, request: Request, response_id: str) -> DRFResponse:
        """Erase a stored response or a task's result, with its task and events
        (a running one stops); later turns of its conversation stay."""
        records.erase(erasable_responses(owner_of(request), response_id, param="response_id"))
        return DRFResponse(protocol.deleted_object(response_id))


def _final_answer(body: dict[str, Any], headers: dict[str, str]) -> HttpResponse:
    if body["status"] == "failed":
        raise ProblemError(body["error"]["code"], body["error"]["detail"])
    return JsonResponse(body, headers=headers)


@csrf_free
async def create_response(request: HttpRequest) -> HttpResponseBase:
    """POST /lmsp/v1/responses: a synchronous answer or a direct event stream.

    The generation runs on a worker either way; this view follows its event
    log. If the client goes away first, the generation is cancelled, unless
    nobody but this client could want it (``direct.cancels_if_left``).
    """
    check_method(request, ("POST",))
    token = await event_reader.authenticated(request, "responses:write")
    key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    body = await cpu_call(_validated_body, request)
    leave = direct.cancels_if_left(key, body["stream"])
    task = await direct.accepted(db_call(_submitted, token, body, key), leave)
    access = StreamAccess.of(token)
    release = direct.admit_replay(task, token)
    if body["stream"]:
        events = direct.delivered_events(task, leave, access, release)
        return StreamingHttpResponse(
            admitted(_direct_stream(events), release),
            content_type="text/event-stream",
            headers={**SSE_HEADERS, **budgets.headers_of(task)},
        )
    result = await direct.final_result(task, leave, access, release)
    return _final_answer(result, budgets.headers_of(task))


def _submitted(token: ApiToken, body: dict[str, Any], key: str | None) -> Task:
    """``submit`` for the request's token, with the models it may use."""
    return submit(
        token.owner,
        body,
        kind=TaskKind.DIRECT,
        idempotency_key=key,
        allowed_models=allowed_models(token),
        token_id=token.pk,
    )


def _validated_body(request: HttpRequest) -> dict[str, Any]:
    """Parse and validate the body: CPU work for up to a megabyte, so it runs
    on a worker thread, never on the event loop."""
    return validate_response_request(json_body(request))


async def _direct_stream(
    events: AsyncGenerator[StoredEvent | None, None],
) -> AsyncGenerator[bytes, None]:
    async with aclosing(events) as delivered:
        async for event in delivered:
            yield lmsp_frame(event)
