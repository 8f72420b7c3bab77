"""The body limit and the upload timeout, enforced while the body arrives.

Django's ASGI handler reads a whole request body before any middleware or
view runs, so a limit checked there comes after the upload, and a client
sending one byte a minute holds the request open for ever. This wrapper sits
around the Django application (``lmsp_project/asgi.py``), before
authentication: it reads the body itself and answers

- ``413 payload_too_large`` as soon as the ``Content-Length`` header or the
  bytes received pass ``LMSP_MAX_BODY_BYTES``, without reading the rest;
- ``408 request_timeout`` when the whole body has not arrived
  ``LMSP_BODY_TIMEOUT_SECONDS`` after the request began;

both as problem documents (or, under a path prefix given a shape of its
own, such as OpenAI's error object under ``/v1/``), with ``Connection: close`` (the unread rest of
the body cannot be skipped). A body that keeps to both is handed to Django
as one message; later ``receive`` calls (a client's disconnect during a
stream) pass through. The views served outside Django's request handler
(``lmsp_core.lean``) have their bodies read by the same code
(``BoundedBody.read``), so that both answer alike.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from django.conf import settings

from .errors import STATUS_BY_CODE, problem

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_DIGITS = re.compile(rb"[0-9]{1,30}")


# How errors are shaped under a path prefix: the problem object in, the body out.
ProblemShape = Callable[[dict[str, Any]], dict[str, Any]]


async def _answer(send: Send, code: str, detail: str, shape: ProblemShape | None) -> None:
    body = problem(code, detail)
    content_type = b"application/problem+json"
    if shape is not None:
        body, content_type = shape(body), b"application/json"
    encoded = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": STATUS_BY_CODE[code],
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(encoded)).encode()),
                (b"lmsp-version", b"1.0"),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": encoded})


def _too_large_detail(limit: int) -> str:
    return f"The request body is larger than {limit} bytes."


class BoundedBody:
    """ASGI middleware: the request body within ``LMSP_MAX_BODY_BYTES`` and
    ``LMSP_BODY_TIMEOUT_SECONDS``, or a problem document before the rest."""

    def __init__(self, app: ASGIApp, shapes: dict[str, ProblemShape] | None = None) -> None:
        self.app = app
        self.shapes = shapes or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body = await self.read(scope, receive, send)
        if body is not None:
            await self.app(scope, replayed(body, receive), send)

    async def read(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body of an HTTP request; None when it was refused (and
        answered here) or the client left before sending it. Public, so that
        the views ``lmsp_core.lean`` serves have their bodies bounded by the
        same code as Django's."""
        path = scope.get("path", "")
        shape = next((s for prefix, s in self.shapes.items() if path.startswith(prefix)), None)
        limit = settings.LMSP_MAX_BODY_BYTES
        timeout = settings.LMSP_BODY_TIMEOUT_SECONDS
        for name, value in scope.get("headers", []):
            if name == b"content-length" and _DIGITS.fullmatch(value) and int(value) > limit:
                await _answer(send, "payload_too_large", _too_large_detail(limit), shape)
                return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except TimeoutError:
                await _answer(
                    send,
                    "request_timeout",
                    f"The request body did not arrive within {timeout:g} seconds.",
                    shape,
                )
                return None
            if message["type"] == "http.disconnect":
                return None  # the client left before sending its body: nobody to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await _answer(send, "payload_too_large", _too_large_detail(limit), shape)
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def replayed(body: bytes, receive: Receive) -> Receive:
    """``receive`` for an application after ``body`` was read from it: the
    body as one message, then what the client sends (its disconnect)."""
    delivered = False

    async def replay() -> Message:
        nonlocal delivered
        if delivered:
            return await receive()
        delivered = True
        return {"type": "http.request", "body": body, "more_body": False}

    return replay
