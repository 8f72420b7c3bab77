"""The OpenAI-compatible endpoints: each translates the request, then takes
the same path as LMSP's own (``validate_response_request``, ``submit``, the
event log) and translates what comes back.

Scopes are LMSP's: ``models:read`` for models, ``responses:write`` to create
a response, ``responses:read`` to fetch a stored one. A background response
is an LMSP task, so creating one needs ``tasks:write`` too, and reading,
resuming or cancelling it needs ``tasks:read`` / ``tasks:write``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from django.contrib.auth.models import User
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)

from accounts_app.models import ApiToken
from accounts_app.services import authenticate_bearer, require_scope
from generation.registry import ModelSpec, get_model, listed_models
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.http import cpu_call, db_call, json_body
from lmsp_core.ids import is_valid_id
from lmsp_core.protocol import KEEPALIVE_FRAME
from lmsp_core.validation import integer_param
from responses_app import direct, records
from responses_app.models import Response
from responses_app.selectors import erasable_responses
from responses_app.serializers import validate_response_request
from responses_app.submit import submit
from tasks_app import budgets, event_reader, idempotency
from tasks_app import services as task_services
from tasks_app.event_log import StoredEvent
from tasks_app.model_access import allowed_models
from tasks_app.models import Task, TaskKind
from tasks_app.stream_access import StreamAccess
from tasks_app.stream_admission import admit, admitted
from tasks_app.streams import SSE_HEADERS, follow_events

from . import chat, responses
from .errors import ParamMap, named_as_sent, openai_view

T = TypeVar("T")

# --- models -----------------------------------------------------------------------


def model_object(spec: ModelSpec) -> dict[str, Any]:
    return {"id": spec.id, "object": "model", "created": 0, "owned_by": "lmsp"}


@openai_view("GET")
async def model_list(request: HttpRequest) -> HttpResponse:
    token = await event_reader.authenticated(request, "models:read")
    allowed = await db_call(allowed_models, token)
    data = [model_object(spec) for spec in listed_models(allowed)]
    return JsonResponse({"object": "list", "data": data})


@openai_view("GET")
async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    token = await event_reader.authenticated(request, "models:read")
    allowed = await db_call(allowed_models, token)
    return JsonResponse(model_object(get_model(model_id, param="model", allowed=allowed)))


# --- shared -----------------------------------------------------------------------


def _failed(result: dict[str, Any]) -> ProblemError:
    error = result["error"]
    return ProblemError(error["code"], error["detail"])


def _event_stream(
    frames: AsyncGenerator[bytes, None],
    release: Callable[[], None],
    headers: dict[str, str] | None = None,
) -> StreamingHttpResponse:
    """A stream that holds a place under the stream caps (``release``: what
    gave it, called when the stream ends or is dropped), with ``headers``
    beside the SSE ones."""
    return StreamingHttpResponse(
        admitted(frames, release),
        content_type="text/event-stream",
        headers={**SSE_HEADERS, **(headers or {})},
    )


def _data_frame(data: dict[str, Any] | str) -> bytes:
    body = data if isinstance(data, str) else protocol.dumps(data)
    return f"data: {body}\n\n".encode()


def _translated(translate: Callable[[object], T], request: HttpRequest) -> T:
    """The body parsed and turned into an LMSP request. Parsing, like the
    validation after it, is CPU work for up to a megabyte: both run on a worker
    thread (``cpu_call``), never on the event loop, as in LMSP's own view."""
    return translate(json_body(request))


def _submit(token: ApiToken, validated: dict[str, Any], kind: str, key: str | None) -> Task:
    """``submit`` for the request's token, with the models it may use."""
    allowed = allowed_models(token)
    return submit(
        token.owner,
        validated,
        kind=kind,
        idempotency_key=key,
        allowed_models=allowed,
        token_id=token.pk,
    )


async def _submitted(
    token: ApiToken,
    validated: dict[str, Any],
    kind: str,
    key: str | None,
    param_of: ParamMap,
    stream: bool,
) -> Task:
    with named_as_sent(param_of):
        start = db_call(_submit, token, validated, kind, key)
        if kind == TaskKind.DIRECT:  # cancelled if the client leaves (direct's rules)
            leave = direct.cancels_if_left(key, stream)
            return await direct.accepted(start, leave)
        task: Task = await start
        return task


# --- chat completions ---------------------------------------------------------------


@openai_view("POST")
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    token = await event_reader.authenticated(request, "responses:write")
    key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    translated = await cpu_call(_translated, chat.lmsp_request, request)
    with named_as_sent(translated.param_of):
        validated = await cpu_call(validate_response_request, translated.request)
    task = await _submitted(
        token, validated, TaskKind.DIRECT, key, translated.param_of, translated.stream
    )
    access = StreamAccess.of(token)
    release = direct.admit_replay(task, token)
    if translated.stream:
        chunks = chat.ChunkTranslator(
            task.response_id,
            protocol.timestamp(task.created_at),
            validated["model"],
            translated.include_usage,
        )
        leave = direct.cancels_if_left(key, True)
        events = direct.delivered_events(task, leave, access, release)
        return _event_stream(_chat_frames(events, chunks), release, budgets.headers_of(task))
    result = await direct.final_result(task, direct.cancels_if_left(key, False), access, release)
    if result["status"] == "failed":
        raise _failed(result)
    return JsonResponse(chat.completion(result), headers=budgets.headers_of(task))


async def _chat_frames(
    events: AsyncGenerator[StoredEvent | None, None], chunks: chat.ChunkTranslator
) -> AsyncGenerator[bytes, None]:
    failed = False  # an error chunk (a failed or cut short answer) ends without [DONE]
    async with aclosing(events) as delivered:
        async for event in delivered:
            if event is None:
                yield KEEPALIVE_FRAME
                continue
            for chunk in chunks.translate(event.event, json.loads(event.data)):
                failed = failed or "error" in chunk
                yield _data_frame(chunk)
    if not failed:  # OpenAI ends a stream that failed with the error alone
        yield _data_frame("[DONE]")


# --- responses --------------------------------------------------------------------


def _snapshot(task_id: str) -> tuple[dict[str, Any], dict[str, Any], str, bool]:
    """The response of a task as LMSP shows it, its generation parameters, the
    task's status and whether it is a background response."""
    task = Task.objects.select_related("response").get(id=task_id)
    return (
        protocol.response_object(task.response),
        task.response.params,
        task.status,
        task.kind == TaskKind.TASK,
    )


def _openai_response(task_id: str) -> dict[str, Any]:
    result, params, status, background = _snapshot(task_id)
    return responses.response_object(result, params, background=background, status=status)


def _translator(task_id: str) -> responses.EventTranslator:
    result, params, _, background = _snapshot(task_id)
    started = {**result, "status": "in_progress", "output": [], "usage": None, "error": None}
    base = responses.response_object(started, params, background=background)
    return responses.EventTranslator(base=base)


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {protocol.dumps(data)}\n\n".encode()


async def _response_frames(
    events: AsyncGenerator[StoredEvent | None, None],
    translator: responses.EventTranslator,
    starting_after: int = -1,
) -> AsyncGenerator[bytes, None]:
    async with aclosing(events) as followed:
        async for event in followed:
            if event is None:
                yield KEEPALIVE_FRAME
                continue
            for kind, data in translator.translate(event.event, json.loads(event.data)):
                if data["sequence_number"] > starting_after:
                    yield _sse(kind, data)


@openai_view("POST")
async def create_response(request: HttpRequest) -> HttpResponseBase:
    token = await event_reader.authenticated(request, "responses:write")
    key = idempotency.parse_key(request.headers.get(idempotency.HEADER))
    translated = await cpu_call(_translated, responses.lmsp_request, request)
    if translated.background:
        require_scope(token, "tasks:write")
    with named_as_sent(translated.param_of):
        validated = await cpu_call(validate_response_request, translated.request)
    kind = TaskKind.TASK if translated.background else TaskKind.DIRECT
    task = await _submitted(token, validated, kind, key, translated.param_of, translated.stream)
    access = StreamAccess.of(token)
    if translated.stream:
        translator = await db_call(_translator, task.id)
        release = direct.admit_replay(task, token)
        events = (
            follow_events(task.id, 0, access=access, release=release)
            if translated.background
            else direct.delivered_events(task, direct.cancels_if_left(key, True), access, release)
        )
        return _event_stream(
            _response_frames(events, translator), release, budgets.headers_of(task)
        )
    if translated.background:
        return JsonResponse(
            await db_call(_openai_response, task.id), headers=budgets.headers_of(task)
        )
    # read before the answer is delivered: a store: false response is then gone
    _, params, _, _ = await db_call(_snapshot, task.id)
    release = direct.admit_replay(task, token)
    result = await direct.final_result(task, direct.cancels_if_left(key, False), access, release)
    if result["status"] == "failed":
        raise _failed(result)
    answer = responses.response_object(result, params, background=False)
    return JsonResponse(answer, headers=budgets.headers_of(task))


def _owned_response(owner: User, response_id: str) -> tuple[Response, Task | None]:
    """A response the owner can read back: a stored one or a background one
    (whose task is kept until task retention). Anything else is 404; an id
    that cannot be a response's (NUL included) never reaches the database."""
    if is_valid_id(response_id, "resp"):
        task = (
            Task.objects.select_related("response")
            .filter(response_id=response_id, owner=owner, kind=TaskKind.TASK)
            .first()
        )
        if task is not None:
            return task.response, task
        response = Response.objects.filter(id=response_id, owner=owner, store=True).first()
        if response is not None:
            return response, None
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    raise ProblemError("response_not_found", f"No response with id {shown!r}.", param="response_id")


def _readable(
    token: ApiToken, response_id: str, background_scope: str, scope: str
) -> tuple[Response, Task | None]:
    response, task = _owned_response(token.owner, response_id)
    require_scope(token, background_scope if task is not None else scope)
    return response, task


async def _token(request: HttpRequest) -> ApiToken:
    token: ApiToken = await db_call(authenticate_bearer, request.headers.get("Authorization"))
    return token


def _starting_after(request: HttpRequest) -> int:
    """``starting_after``: a sequence number in ASCII digits; absent or -1:
    from the first event. (``str.isdigit`` once let ``²`` through to ``int``.)"""
    raw = request.GET.get("starting_after", "-1")
    return -1 if raw == "-1" else integer_param(raw, "starting_after", 0)


@openai_view("GET", "DELETE")
async def response_detail(request: HttpRequest, response_id: str) -> HttpResponseBase:
    """``GET /v1/responses/{id}``; with ``stream=true`` the events of a
    background response from the start or after ``starting_after``.
    ``DELETE``: ``delete_response``."""
    token = await _token(request)
    if request.method == "DELETE":
        return await delete_response(token, response_id)
    for name in request.GET:
        if name not in ("stream", "starting_after"):
            raise ProblemError(
                "invalid_request", f"The query parameter {name!r} is not supported.", param=name
            )
    stream = request.GET.get("stream", "false")
    if stream not in ("true", "false"):
        raise ProblemError("invalid_request", "stream must be true or false.", param="stream")
    if stream == "false" and "starting_after" in request.GET:
        raise ProblemError(
            "invalid_request", "starting_after needs stream=true.", param="starting_after"
        )
    response, task = await db_call(_readable, token, response_id, "tasks:read", "responses:read")
    if stream == "false":
        if task is not None:
            return JsonResponse(await db_call(_openai_response, task.id))
        result = protocol.response_object(response)
        return JsonResponse(responses.response_object(result, response.params, background=False))
    if task is None:
        raise ProblemError(
            "invalid_request",
            "Only background responses can be streamed again.",
            param="stream",
        )
    after = _starting_after(request)
    if task.pruned_through > 0:
        raise ProblemError(
            "event_history_expired",
            f"The events of {response_id} were removed by retention; fetch the response "
            "without stream=true.",
        )
    translator = await db_call(_translator, task.id)
    release = admit(token.pk, token.owner_id)
    events = follow_events(task.id, 0, access=StreamAccess.of(token), release=release)
    return _event_stream(_response_frames(events, translator, after), release)


def _erase(token: ApiToken, response_id: str) -> None:
    require_scope(token, "responses:write")
    records.erase(erasable_responses(token.owner, response_id, param="response_id"))


async def delete_response(token: ApiToken, response_id: str) -> HttpResponse:
    """``DELETE /v1/responses/{id}`` (``responses:write``): what LMSP's DELETE
    erases, answered in OpenAI's shape."""
    await db_call(_erase, token, response_id)
    return JsonResponse({"id": response_id, "object": "response", "deleted": True})


@openai_view("POST")
async def cancel_response(request: HttpRequest, response_id: str) -> HttpResponse:
    token = await _token(request)
    _, task = await db_call(_readable, token, response_id, "tasks:write", "tasks:write")
    if task is None:
        raise ProblemError(
            "invalid_request",
            "Only background responses can be cancelled.",
            param="response_id",
        )
    await db_call(task_services.cancel_task, task)
    return JsonResponse(await db_call(_openai_response, task.id))


@openai_view()
async def not_found(request: HttpRequest, *args: object, **kwargs: object) -> HttpResponse:
    raise ProblemError("not_found", f"There is nothing at {request.path}.")
