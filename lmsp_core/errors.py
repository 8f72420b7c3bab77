"""Problem documents (RFC 9457) for every error the API gives.

``ProblemError`` is raised anywhere below a view; ``problem_response`` turns
it into the HTTP answer, and ``drf_exception_handler`` maps DRF's own
exceptions onto the same codes so no answer is ever an HTML page.
"""

from __future__ import annotations

import logging
from typing import Any

from django.http import JsonResponse
from rest_framework import exceptions as drf_exceptions

log = logging.getLogger(__name__)

STATUS_BY_CODE = {
    "invalid_request": 400,
    "unsupported_version": 400,
    "unsupported_capability": 400,
    "unsupported_content_type": 400,
    "context_length_exceeded": 400,
    "unauthorized": 401,
    "insufficient_scope": 403,
    "not_found": 404,
    "model_not_found": 404,
    "response_not_found": 404,
    "task_not_found": 404,
    "method_not_allowed": 405,
    "request_timeout": 408,
    "idempotency_key_in_use": 409,
    "task_not_cancellable": 409,
    "event_history_expired": 410,
    "payload_too_large": 413,
    "idempotency_key_reused": 422,
    "rate_limited": 429,
    "internal_error": 500,
    "generation_failed": 502,
    "worker_lost": 502,
    "overloaded": 503,
}

TITLES = {
    "invalid_request": "Invalid request",
    "unsupported_version": "Unsupported protocol version",
    "unsupported_capability": "Unsupported capability",
    "unsupported_content_type": "Unsupported content type",
    "context_length_exceeded": "Context length exceeded",
    "unauthorized": "Unauthorized",
    "insufficient_scope": "Insufficient scope",
    "not_found": "Not found",
    "model_not_found": "Model not found",
    "response_not_found": "Response not found",
    "task_not_found": "Task not found",
    "method_not_allowed": "Method not allowed",
    "request_timeout": "Request timeout",
    "idempotency_key_in_use": "Idempotency key in use",
    "task_not_cancellable": "Task not cancellable",
    "event_history_expired": "Event history expired",
    "payload_too_large": "Payload too large",
    "idempotency_key_reused": "Idempotency key reused",
    "rate_limited": "Rate limited",
    "internal_error": "Internal error",
    "generation_failed": "Generation failed",
    "worker_lost": "Worker lost",
    "overloaded": "Overloaded",
}


def problem(code: str, detail: str, param: str | None = None, **extra: object) -> dict[str, Any]:
    """The problem object, as used in HTTP answers, failed tasks and SSE events."""
    body = {
        "type": f"urn:lmsp:error:{code}",
        "title": TITLES[code],
        "status": STATUS_BY_CODE[code],
        "detail": detail,
        "code": code,
    }
    if param is not None:
        body["param"] = param
    body.update(extra)
    return body


class ProblemError(Exception):
    """An error that the client should see as a problem document."""

    def __init__(
        self,
        code: str,
        detail: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: object,
    ) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail
        self.param = param
        self.headers = headers or {}
        self.extra = extra

    @property
    def status(self) -> int:
        return STATUS_BY_CODE[self.code]

    def as_problem(self) -> dict[str, Any]:
        return problem(self.code, self.detail, self.param, **self.extra)


def problem_response(error: ProblemError) -> JsonResponse:
    response = JsonResponse(
        error.as_problem(), status=error.status, content_type="application/problem+json"
    )
    for name, value in error.headers.items():
        response[name] = value
    return response


def unauthorized(detail: str) -> ProblemError:
    return ProblemError("unauthorized", detail, headers={"WWW-Authenticate": 'Bearer realm="lmsp"'})


def drf_exception_handler(exc: Exception, context: dict[str, Any]) -> JsonResponse | None:
    if isinstance(exc, ProblemError):
        return problem_response(exc)
    if isinstance(exc, drf_exceptions.NotAuthenticated | drf_exceptions.AuthenticationFailed):
        return problem_response(unauthorized("A valid bearer token is required."))
    if isinstance(exc, drf_exceptions.MethodNotAllowed):
        view = context.get("view")
        allowed = ", ".join(view.allowed_methods) if view is not None else ""
        return problem_response(
            ProblemError(
                "method_not_allowed",
                f"Method {context['request'].method} is not allowed here.",
                headers={"Allow": allowed},
            )
        )
    if isinstance(exc, drf_exceptions.ParseError):
        return problem_response(
            ProblemError("invalid_request", f"Malformed JSON body: {exc}", param="body")
        )
    if isinstance(exc, drf_exceptions.UnsupportedMediaType):
        return problem_response(
            ProblemError(
                "invalid_request",
                "The body must be JSON (Content-Type: application/json).",
                param="Content-Type",
            )
        )
    if isinstance(exc, drf_exceptions.NotFound):
        return problem_response(ProblemError("not_found", "No such resource."))
    if isinstance(exc, drf_exceptions.APIException):
        code = "invalid_request" if exc.status_code < 500 else "internal_error"
        log.warning("Unmapped API exception %r", exc)
        return problem_response(ProblemError(code, str(exc)))
    return None  # the middleware answers any other exception with internal_error
