"""OpenAI's error shape for every answer under ``/v1/``.

LMSP raises ``ProblemError`` everywhere below the views; this module is the
one place that turns a problem (raised, or stored in a failed response) into
``{"error": {"message", "type", "param", "code"}}`` with the same HTTP
status, so that OpenAI SDKs raise their matching exception
(``BadRequestError`` for 400, ``NotFoundError`` for 404, ...).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, cast

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponseBase, JsonResponse

from lmsp_core.errors import STATUS_BY_CODE, ProblemError
from lmsp_core.middleware import too_large

log = logging.getLogger(__name__)

# OpenAI's error ``type`` per HTTP status; 5xx are ``server_error``.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    410: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def error_object(problem: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's error object for an LMSP problem object (raised or stored)."""
    status = problem.get("status") or STATUS_BY_CODE.get(str(problem.get("code")), 500)
    return {
        "message": problem.get("detail") or problem.get("title") or "Error.",
        "type": error_type(status),
        "param": problem.get("param"),
        "code": problem.get("code"),
    }


def error_body(problem: dict[str, Any]) -> dict[str, Any]:
    """The whole answer body of an error on the /v1/ routes."""
    return {"error": error_object(problem)}


def error_response(error: ProblemError) -> JsonResponse:
    response = JsonResponse(error_body(error.as_problem()), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def internal_error() -> ProblemError:
    return ProblemError("internal_error", "The server failed to answer.")


View = Callable[..., Coroutine[Any, Any, HttpResponseBase]]


def openai_view(*methods: str) -> Callable[[View], View]:
    """An async view under ``/v1/``: bearer tokens, no CSRF, only ``methods``
    (else 405 with ``Allow``; none named: any), and every error in OpenAI's shape."""

    def decorate(view: View) -> View:
        @functools.wraps(view)
        async def wrapper(
            request: HttpRequest, *args: object, **kwargs: object
        ) -> HttpResponseBase:
            try:
                if methods and request.method not in methods:
                    raise ProblemError(
                        "method_not_allowed",
                        f"Method {request.method} is not allowed here.",
                        headers={"Allow": ", ".join(methods)},
                    )
                return await view(request, *args, **kwargs)
            except ProblemError as error:
                return error_response(error)
            except RequestDataTooBig:
                return error_response(too_large())
            except Exception:
                log.exception("Unhandled error on %s %s", request.method, request.path)
                return error_response(internal_error())

        cast(Any, wrapper).csrf_exempt = True
        return wrapper

    return decorate


ParamMap = Callable[[str], str]


@contextmanager
def named_as_sent(param_of: ParamMap) -> Iterator[None]:
    """Errors raised by LMSP's validation and submission name LMSP's fields;
    rename them to the fields of the OpenAI request the client sent."""
    try:
        yield
    except ProblemError as error:
        if error.param:
            renamed = param_of(error.param)
            if error.detail.startswith(f"{error.param}: "):
                error.detail = f"{renamed}: " + error.detail[len(error.param) + 2 :]
            error.param = renamed
        raise
