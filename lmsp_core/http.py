"""Helpers for the API's async views (direct responses and event streams)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

from asgiref.sync import sync_to_async
from django.db import close_old_connections, connection
from django.http import HttpRequest

from .errors import ProblemError
from .jsonbody import loads_strict


async def db_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ORM code from an async view and give its connection back at once.

    The request's thread would otherwise keep its connection until the
    request ends, which for a stream is when the stream ends.
    """

    def call() -> Any:
        close_old_connections()
        try:
            return function(*args, **kwargs)
        finally:
            connection.close()

    return await sync_to_async(call, thread_sensitive=False)()


async def cpu_call(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run CPU work (parsing, validating a body) on a worker thread, so that
    the event loop keeps serving other requests and streams meanwhile."""
    return await sync_to_async(function, thread_sensitive=False)(*args, **kwargs)


def check_method(request: HttpRequest, allowed: tuple[str, ...]) -> None:
    if request.method not in allowed:
        raise ProblemError(
            "method_not_allowed",
            f"Method {request.method} is not allowed here.",
            headers={"Allow": ", ".join(allowed)},
        )


def json_body(request: HttpRequest) -> object:
    content_type = request.headers.get("Content-Type", "application/json")
    if content_type.split(";")[0].strip().lower() != "application/json":
        raise ProblemError(
            "invalid_request",
            "The body must be JSON (Content-Type: application/json).",
            param="Content-Type",
        )
    if not request.body:
        raise ProblemError("invalid_request", "The request body is empty.", param="body")
    return loads_strict(request.body)


def csrf_free(view: Callable[..., Any]) -> Callable[..., Any]:
    """Bearer-token endpoints carry no cookies, so CSRF does not apply."""
    cast(Any, view).csrf_exempt = True
    return functools.wraps(view)(view)
