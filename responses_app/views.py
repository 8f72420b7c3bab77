"""Models and responses endpoints (section 6.1-6.3, contract sections 4-5)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable

from django.db import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from rest_framework.request import Request
from rest_framework.response import Response as DRFResponse
from rest_framework.views import APIView

from accounts_app.authentication import authenticate
from generation.registry import available_models, get_model
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.http import check_method, csrf_free, db_call, json_body
from tasks_app import idempotency
from tasks_app import services as task_services
from tasks_app.models import Task, TaskKind
from tasks_app.streams import SSE_HEADERS, follow

from . import records
from .selectors import stored_response
from .serializers import validate_response_request
from .submit import submit

log = logging.getLogger(__name__)


class ModelListView(APIView):
    required_scopes = {"GET": "models:read"}

    def get(self, request: Request) -> DRFResponse:
        models = [protocol.model_object(spec) for spec in available_models().values()]
        return DRFResponse(protocol.list_object(models))


class ModelDetailView(APIView):
    required_scopes = {"GET": "models:read"}

    def get(self, request: Request, model_id: str) -> DRFResponse:
        return DRFResponse(protocol.model_object(get_model(model_id, param="model_id")))


class ResponseDetailView(APIView):
    required_scopes = {"GET": "responses:read"}

    def get(self, request: Request, response_id: str) -> DRFResponse:
        response = stored_response(request.user, response_id, param="response_id")
        return DRFResponse(protocol.response_object(response))


def _final_answer(task_id: str) -> HttpResponse:
    task = Task.objects.select_related("response").get(id=task_id)
    body = protocol.response_object(task.response)
    records.discard_unneeded(delivered_task_id=task_id)
    if task.response.status == "failed":
        error = task.response.error
        raise ProblemError(error["code"], error["detail"])
    return JsonResponse(body)


@csrf_free
async def create_response(request: HttpRequest) -> HttpResponse:
    """POST /lmsp/v1/responses: a synchronous answer or a direct event stream.

    The generation runs on a worker either way; this view follows its event
    log. If the client goes away first, the generation is cancelled.
    """
    check_method(request, ("POST",))
    token = await authenticate(request, "responses:write")
    key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    body = validate_response_request(json_body(request))
    task = await _accepted(
        db_call(submit, token.owner, body, kind=TaskKind.DIRECT, idempotency_key=key)
    )
    if body["stream"]:
        return StreamingHttpResponse(
            _direct_stream(task.id), content_type="text/event-stream", headers=SSE_HEADERS
        )
    try:
        async for _ in follow(task.id, 0):
            pass
    except asyncio.CancelledError:
        await asyncio.shield(db_call(task_services.cancel_abandoned, task.id))
        raise
    return await db_call(_final_answer, task.id)


async def _accepted(start: Awaitable[Task]) -> Task:
    """Start a generation even if the client leaves meanwhile, and then stop it:
    the database work cannot be interrupted halfway, and nobody would read
    what it generates."""
    started = asyncio.ensure_future(start)
    try:
        return await asyncio.shield(started)
    except asyncio.CancelledError:
        started.add_done_callback(_cancel_orphan)
        raise


def _cancel_orphan(started: asyncio.Future) -> None:
    if started.cancelled() or started.exception() is not None:
        return
    asyncio.ensure_future(db_call(task_services.cancel_abandoned, started.result().id))


async def _direct_stream(task_id: str):  # noqa: ANN202
    """Follow a direct generation; only the client's going away cancels it.

    The client is gone when the server cancels the stream (Django does on
    ``http.disconnect``) or closes it unfinished. Any other error is the
    server's own: the generation goes on and can be fetched or replayed
    with the same ``Idempotency-Key``.
    """
    delivered = client_gone = False
    try:
        async for frame in follow(task_id, 0):
            yield frame
        delivered = True
    except (asyncio.CancelledError, GeneratorExit):
        client_gone = True
        raise
    finally:
        try:
            if delivered:
                await db_call(records.discard_unneeded, delivered_task_id=task_id)
            elif client_gone:
                await asyncio.shield(db_call(task_services.cancel_abandoned, task_id))
        except DatabaseError:  # the stream itself is whole: do not break it now
            log.warning("Could not tidy up after the stream of %s", task_id, exc_info=True)
