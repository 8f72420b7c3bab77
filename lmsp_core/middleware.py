"""Protocol rules that hold for every answer under ``/lmsp/``.

Every answer carries ``LMSP-Version: 1.0``; a request for another major
version is refused; oversized bodies are 413; and an exception that escapes a
view becomes a ``500 internal_error`` problem document, never an HTML page.

Outside the APIs (the admin), a path or query holding U+0000 is refused with
400 (``NulRefusalMiddleware``).
"""

from __future__ import annotations

import logging

from django.conf import settings
from django.core.exceptions import BadRequest, RequestDataTooBig
from django.http import HttpRequest, HttpResponse
from django.utils.deprecation import MiddlewareMixin

from .errors import ProblemError, problem_response

log = logging.getLogger(__name__)

API_PREFIX = "/lmsp/"
PROTOCOL_VERSION = "1.0"
# Paths whose views refuse U+0000 themselves, each in its API's own answer.
APIS = (API_PREFIX, "/v1/")


class ApiErrorMiddleware(MiddlewareMixin):
    """The errors of one API that no view answered, in that API's own shape:
    a request refused before its view (an oversized body), an exception
    that escapes a view, and an error Django answers below the views (a bad
    ``Host`` header, say) as an HTML page. Each API names its paths
    (``prefix``), its error documents (``render``, and the content type
    they carry) and what it checks of a request (``check_request``)."""

    prefix: str
    error_content_type: str

    def render(self, error: ProblemError) -> HttpResponse:
        raise NotImplementedError

    def check_request(self, request: HttpRequest) -> None:
        check_body_size(request.headers.get("Content-Length"))

    def process_request(self, request: HttpRequest) -> HttpResponse | None:
        if not request.path.startswith(self.prefix):
            return None
        try:
            self.check_request(request)
        except ProblemError as error:
            return self.render(error)
        return None

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith(self.prefix):
            return None
        if isinstance(exception, ProblemError):
            return self.render(exception)
        if isinstance(exception, RequestDataTooBig):
            return self.render(too_large())
        log.exception("Unhandled error on %s %s", request.method, request.path)
        return self.render(ProblemError("internal_error", "The server failed to answer."))

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if not request.path.startswith(self.prefix) or response.status_code < 400:
            return response
        if response.get("Content-Type", "").startswith(self.error_content_type):
            return response  # a view's own error
        code = FALLBACK_CODES.get(response.status_code, "internal_error")
        kept = {name: response[name] for name in ("Allow",) if response.has_header(name)}
        return self.render(ProblemError(code, response.reason_phrase + ".", headers=kept))


class ProtocolMiddleware(ApiErrorMiddleware):
    """``/lmsp/``: problem documents, and ``LMSP-Version`` checked on every
    request and set on every answer."""

    prefix = API_PREFIX
    error_content_type = "application/problem+json"

    def render(self, error: ProblemError) -> HttpResponse:
        return problem_response(error)

    def check_request(self, request: HttpRequest) -> None:
        check_version(request.headers.get("LMSP-Version"))
        super().check_request(request)

    def process_response(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        response = super().process_response(request, response)
        if request.path.startswith(API_PREFIX):
            response["LMSP-Version"] = PROTOCOL_VERSION
        return response


FALLBACK_CODES = {
    400: "invalid_request",
    404: "not_found",
    405: "method_not_allowed",
    413: "payload_too_large",
}


def check_version(header: str | None) -> None:
    if header is None:
        return
    major = header.strip().split(".", 1)[0]
    if major != "1":
        raise ProblemError(
            "unsupported_version",
            f"LMSP-Version {header!r} is not supported; this service speaks 1.0.",
            param="LMSP-Version",
        )


def too_large() -> ProblemError:
    return ProblemError(
        "payload_too_large",
        f"The request body is larger than {settings.LMSP_MAX_BODY_BYTES} bytes.",
    )


def check_body_size(content_length: str | None) -> None:
    if content_length and content_length.isascii() and content_length.isdigit():
        if int(content_length) > settings.LMSP_MAX_BODY_BYTES:
            raise too_large()


class NulRefusalMiddleware(MiddlewareMixin):
    """U+0000 in the path or the query of a page outside the APIs is refused
    with Django's 400: PostgreSQL stores none, and an admin page given one in
    an id, a search or a filter answered 500 (psycopg's ``DataError``). Forms
    refuse it already (Django's ``ProhibitNullCharactersValidator``); the
    APIs' views refuse it themselves, in their own answers."""

    def process_request(self, request: HttpRequest) -> None:
        if request.path.startswith(APIS):
            return
        query = (text for key, values in request.GET.lists() for text in (key, *values))
        if "\x00" in request.path or any("\x00" in text for text in query):
            raise BadRequest("U+0000 in the path or the query.")
