"""OpenAI's error shape for answers under ``/v1/`` that no view wrote.

The views answer their own errors (``errors.openai_view``); this covers what
happens around them: an oversized body, and errors Django answers below the
views (a bad ``Host`` header, say) as an HTML page. ``/lmsp/`` has its own
rules (``lmsp_core.middleware``).
"""

from __future__ import annotations

from django.http import HttpResponse

from lmsp_core.errors import ProblemError
from lmsp_core.middleware import ApiErrorMiddleware

from .errors import error_response


class OpenAIErrorMiddleware(ApiErrorMiddleware):
    """``/v1/``: OpenAI's error objects (``application/json``)."""

    prefix = "/v1/"
    error_content_type = "application/json"

    def render(self, error: ProblemError) -> HttpResponse:
        return error_response(error)
