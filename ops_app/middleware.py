"""Counts every HTTP answer by endpoint and status, and every open SSE stream,
for ``/metrics``, without a line in the views.

The endpoint is the matched URL pattern (``lmsp/v1/tasks/<str:task_id>``),
never the path, so that ids do not become label values. Counting happens in a
thread after the answer is handed on: a slow or absent Redis never delays it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

from django.http import HttpRequest, HttpResponseBase, StreamingHttpResponse
from django.utils.decorators import sync_and_async_middleware

from . import recorders

UNMATCHED = "unmatched"


def endpoint_of(request: HttpRequest) -> str:
    match = getattr(request, "resolver_match", None)
    return match.route if match is not None and match.route else UNMATCHED


def _count_streams(response: HttpResponseBase) -> None:
    if (
        isinstance(response, StreamingHttpResponse)
        and response.is_async
        and response.get("Content-Type", "").startswith("text/event-stream")
    ):
        # The iterator itself, not streaming_content: that wrapper holds the
        # whole response (headers included) for as long as the stream lasts,
        # a kilobyte and more per open stream. Django encodes the chunks
        # (make_bytes) when it sends them, whatever wraps them here.
        response.streaming_content = recorders.counted_stream(cast(Any, response)._iterator)


@sync_and_async_middleware
def request_metrics(get_response: Callable[..., Any]) -> Callable[..., Any]:
    if asyncio.iscoroutinefunction(get_response):

        async def counted_async(request: HttpRequest) -> HttpResponseBase:
            response: HttpResponseBase = await get_response(request)
            _count_streams(response)
            recorders.count_request(
                endpoint_of(request), request.method or "", response.status_code
            )
            return response

        return counted_async

    def counted(request: HttpRequest) -> HttpResponseBase:
        response: HttpResponseBase = get_response(request)
        _count_streams(response)
        method = request.method or ""
        recorders.count_request(endpoint_of(request), method, response.status_code)
        return response

    return counted
