"""OpenAI's error shape for answers under ``/v1/`` that no view wrote.

The views answer their own errors (``errors.openai_view``); this covers what
happens around them: an oversized body, and errors Django answers below the
views (a bad ``Host`` header, say) as an HTML page. ``/lmsp/`` has its own
rules (``lmsp_core.middleware``).
"""

from __future__ import annotations

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

from lmsp_core.errors import ProblemError
from lmsp_core.middleware import FALLBACK_CODES, check_body_size, too_large

from .errors import error_response, internal_error

API_PREFIX = "/v1/"


class OpenAIErrorMiddleware(MiddlewareMixin):
    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        if not request.path.startswith(API_PREFIX):
            return None
        try:
            check_body_size(request.headers.get("Content-Length"))
        except ProblemError as error:
            return error_response(error)
        return None

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith(API_PREFIX):
            return None
        if isinstance(exception, ProblemError):
            return error_response(exception)
        if isinstance(exception, RequestDataTooBig):
            return error_response(too_large())
        return error_response(internal_error())

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if not request.path.startswith(API_PREFIX) or response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith("application/json"):
            return response  # already OpenAI's shape
        code = FALLBACK_CODES.get(response.status_code, "internal_error")
        kept = {name: response[name] for name in ("Allow",) if response.has_header(name)}
        return error_response(ProblemError(code, response.reason_phrase + ".", headers=kept))
