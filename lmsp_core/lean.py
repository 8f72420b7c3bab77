"""Chosen async views served without Django's per-request machinery.

Under Django's ASGI handler every request gets a thread of its own
(asgiref's ``ThreadSensitiveContext``), every hook of every
``MiddlewareMixin`` middleware is a hop to that thread and back (with the
request signals and the response's ``close()``, 21 hops around a view of
this project), two more asyncio tasks watch the request while it is
answered, and a streamed response with its headers and three wrappers of
its iterator stays alive as long as the stream. That weighs on

- follower streams, which one web process holds open by the thousand
  (README, "Event streams at scale"): each cost about 28 KiB of RSS while
  it waited and over 2 ms of CPU to connect before any line of the view ran
  (``bench/README.md``, bench_fanout.py);
- direct responses (``POST /lmsp/v1/responses``, OpenAI's ``/v1/responses``
  and ``/v1/chat/completions``): the hops before the view submits the
  generation are on the path to its first token, and on a busy event loop
  each waits its turn (bench_concurrency.py). In-process, a request
  answered 401 took 3.4 ms through Django's handler, 0.6 ms here.

``LeanViews`` sits in front of Django (``lmsp_project/asgi.py``) and serves
the views it is given, each for one method, itself, on the event loop, with
the same parts Django would use, so that the answers are Django's to the
byte (``tests/test_lean_streams_e2e.py``): the URL resolver, an
``ASGIRequest``, the project's middleware (``settings.MIDDLEWARE``, in its
order: the hooks of ``MiddlewareMixin`` middleware are called directly,
async-capable middleware functions are chained as they are), the view, the
exception handling of ``process_exception`` and ``response_for_exception``,
``log_response`` for 4xx and 5xx, and ``send_response``'s messages. A
waiting stream holds its iterator and one task that listens for the
client's disconnect, which ends the stream at once, as under Django.

A request with a body has it read by ``BoundedBody.read``, the code that
reads it for Django, so the body limit and the upload timeout answer alike
(413, 408). Its view runs in a task of its own while the request's task
listens for the client's disconnect, as Django's handler does; when the
client leaves first, the view's task is cancelled and awaited, so that a
synchronous direct response cancels its generation.

Whatever it cannot answer exactly as Django would goes to Django (the
``app`` given) unchanged, before anything was sent or any view ran (with
the body as it was read): other methods than a view's own, paths that
resolve to other views, requests Django cannot parse, and requests that a
middleware's ``process_request`` answers or refuses itself (a bad ``Host``,
an unsupported ``LMSP-Version``).

What it leaves out, so what a view served here must not need: the
``request_started`` / ``request_finished`` signals and the response's
``close()`` (which close the database connections of the request's thread:
a view served here touches the database only asynchronously or from worker
threads, ``lmsp_core.http.db_call``), a thread per request
(``sync_to_async`` with ``thread_sensitive=True`` would share one thread
among all requests), ``ATOMIC_REQUESTS``, template responses, and for a
request without a body (a follower's: a query or two before its stream)
the cancellation of its view when the client leaves meanwhile: its stream
ends at once instead.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from contextlib import aclosing
from typing import Any, cast

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler, ASGIRequest, get_script_prefix
from django.core.handlers.exception import response_for_exception
from django.http import HttpRequest, HttpResponse, HttpResponseBase, StreamingHttpResponse
from django.urls import Resolver404, ResolverMatch, resolve, set_script_prefix
from django.utils.deprecation import MiddlewareMixin
from django.utils.log import log_response
from django.utils.module_loading import import_string

from .asgi import BoundedBody, Receive, Scope, Send, replayed

Handler = Callable[[HttpRequest], Awaitable[HttpResponseBase]]
# How django-stubs types the ``send`` of ``ASGIHandler.send_response``.
DjangoSend = Callable[[Mapping[str, Any]], Awaitable[None]]


class _Declined(BaseException):
    """A middleware answered or refused the request before its view: Django
    answers it. A ``BaseException``, so that no middleware or exception
    handling on the way out turns it into a response."""


class LeanViews:
    """ASGI application: requests that resolve to one of ``views`` with the
    method it is given for are answered here; everything else goes to ``app``.

    ``app`` is the whole application for the other requests: Django behind
    ``lmsp_core.asgi.BoundedBody``, whose ``read`` bounds the bodies of the
    requests answered here too. ``django`` is Django's own handler, whose
    ``send_response`` writes the answers that are not streams.
    """

    def __init__(
        self, app: BoundedBody, django: ASGIHandler, views: Mapping[Callable[..., Any], str]
    ) -> None:
        self.app = app
        self.django = django
        self.views = dict(views)
        self.methods = frozenset(views.values())
        self._chain: Handler | None = None
        self._view_hooks: list[Callable[..., Any]] = []
        self._exception_hooks: list[Callable[..., Any]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = self._view_of(scope)
        if match is None:
            await self.app(scope, receive, send)
            return
        with_body = _has_body(scope)
        body = await self.app.read(scope, receive, send) if with_body else b""
        if body is None:
            return  # refused (413, 408) and answered, or the client left before its body
        try:
            if with_body:
                response = await _unless_left(self._respond(scope, match, body), receive)
            else:
                response = await self._respond(scope, match, body)
        except _Declined:  # the body, if any, as it was read here; else still the client's
            await self.app(scope, replayed(body, receive) if with_body else receive, send)
            return
        del match
        if response is None:
            return  # the client left while its view ran, which was cancelled
        if isinstance(response, StreamingHttpResponse) and response.is_async:
            stream = _Stream(response)
            del response  # a waiting stream holds only its iterator
            await stream.send(receive, send)
        else:
            await self.django.send_response(response, cast(DjangoSend, send))

    def _view_of(self, scope: Scope) -> ResolverMatch | None:
        """The resolved view when it is one of ours for the request's method,
        else None."""
        if scope["type"] != "http" or scope["method"] not in self.methods:
            return None
        script_name = get_script_prefix(scope)
        path_info = scope["path"].removeprefix(script_name) if script_name else scope["path"]
        try:
            match = resolve(path_info)
        except Resolver404:
            return None
        return match if self.views.get(match.func) == scope["method"] else None

    async def _respond(self, scope: Scope, match: ResolverMatch, body: bytes) -> HttpResponseBase:
        """Django's ``get_response_async`` for a resolved request."""
        script_name = get_script_prefix(scope)
        if script_name:  # unset, reverse() uses the default, "/", as Django would set it
            set_script_prefix(script_name)
        try:
            request = ASGIRequest(scope, io.BytesIO(body))
        except Exception as exc:  # a query string that is not UTF-8: Django's own 400
            raise _Declined from exc
        request.resolver_match = match
        if self._chain is None:
            self._chain = self._build_chain()
        response = await self._chain(request)
        if response.status_code >= 400:
            log_response(
                "%s: %s",
                response.reason_phrase,
                request.path,
                response=cast(HttpResponse, response),  # only its status and content are read
                request=request,
            )
        return response

    def _build_chain(self) -> Handler:
        """The project's middleware around ``_view``, outermost first, as
        Django's ``BaseHandler.load_middleware`` nests it."""
        handler: Handler = _converted(self._view)
        for path in reversed(settings.MIDDLEWARE):
            factory = import_string(path)
            if isinstance(factory, type) and issubclass(factory, MiddlewareMixin):
                instance = factory(handler)
                if hasattr(instance, "process_view"):
                    self._view_hooks.insert(0, instance.process_view)
                if hasattr(instance, "process_exception"):
                    self._exception_hooks.append(instance.process_exception)
                handler = _converted(_inline(instance, handler))
            elif getattr(factory, "async_capable", False):
                handler = _converted(factory(handler))
            else:
                raise TypeError(f"{path} can be served neither inline nor asynchronously")
        return handler

    async def _view(self, request: HttpRequest) -> HttpResponseBase:
        """Django's ``_get_response_async`` for a resolved request."""
        match = request.resolver_match
        assert match is not None  # set by _respond
        response: HttpResponseBase | None
        for hook in self._view_hooks:
            response = hook(request, match.func, match.args, match.kwargs)
            if response is not None:
                return response
        try:
            response = await match.func(request, *match.args, **match.kwargs)
        except Exception as exc:
            for exception_hook in self._exception_hooks:
                response = exception_hook(request, exc)
                if response is not None:
                    return response
            raise
        if response is None:
            raise ValueError(f"The view {match.func.__qualname__} returned None.")
        return response


def _inline(middleware: MiddlewareMixin, inner: Handler) -> Handler:
    """A ``MiddlewareMixin`` around ``inner``, its hooks called directly: they
    only look at the request and the response."""
    process_request = getattr(middleware, "process_request", None)
    process_response = getattr(middleware, "process_response", None)

    async def layer(request: HttpRequest) -> HttpResponseBase:
        if process_request is not None:
            try:
                early = process_request(request)
            except Exception as exc:
                raise _Declined from exc
            if early is not None:
                raise _Declined
        response = await inner(request)
        if process_response is not None:
            response = process_response(request, response)
        return response

    return layer


def _converted(handler: Handler) -> Handler:
    """``convert_exception_to_response``, with no thread for the conversion."""

    async def layer(request: HttpRequest) -> HttpResponseBase:
        try:
            return await handler(request)
        except Exception as exc:
            return response_for_exception(request, exc)

    return layer


def _has_body(scope: Scope) -> bool:
    """Whether the request announces a body: without ``Content-Length`` or
    ``Transfer-Encoding`` it has none (RFC 9112, 6.3)."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


async def _unless_left(
    respond: Coroutine[None, None, HttpResponseBase], receive: Receive
) -> HttpResponseBase | None:
    """The response, or None when the client leaves before it: ``respond``
    is then cancelled and awaited, as Django's handler cancels and awaits the
    request's task, so that a view waiting for a whole generation (a
    synchronous direct response) cancels it."""
    loop = asyncio.get_running_loop()
    view = loop.create_task(respond)
    left = loop.create_task(_disconnect(receive))
    try:
        await asyncio.wait((view, left), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        view.cancel()
        left.cancel()
        raise
    left.cancel()
    if not view.done():
        view.cancel()
    try:
        return await view
    except asyncio.CancelledError:
        if not view.cancelled() or _cancelling():
            raise
        return None


def _cancelling() -> int:
    """Whether the running task itself is being cancelled (its count of requests)."""
    task = asyncio.current_task()
    assert task is not None  # called from a coroutine
    return task.cancelling()


async def _disconnect(receive: Receive) -> None:
    """Returns when the client has left (the body was read before)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class _Stream:
    """Django's ``ASGIHandler.send_response`` for an async stream (the same
    messages, chunks and final empty one), without holding the response, its
    headers or Django's wrappers of its iterator while the stream waits. A
    disconnect of the client ends the stream: its iterator sees the
    cancellation, as under Django's handler, which cancels the request's task.
    """

    __slots__ = ("start", "chunks", "charset")

    def __init__(self, response: StreamingHttpResponse) -> None:
        headers = [
            (name.encode("ascii"), value.encode("latin1")) for name, value in response.items()
        ]
        headers += [
            (b"Set-Cookie", cookie.output(header="").encode("ascii").strip())
            for cookie in response.cookies.values()
        ]
        self.start: dict[str, Any] | None = {
            "type": "http.response.start",
            "status": response.status_code,
            "headers": headers,
        }
        # The iterator itself: streaming_content would wrap it, holding the response.
        self.chunks = cast(Any, response)._iterator
        self.charset = response.charset

    async def send(self, receive: Receive, send: Send) -> None:
        """The body goes out from a task of its own while this one listens to
        the client: ``receive`` answers ``http.disconnect`` when the client
        leaves, or once the response is complete (ASGI). A wake of a waiting
        stream then resumes only the body's coroutines."""
        start, self.start = self.start, None
        assert start is not None  # a stream is sent once
        await send(start)
        del start
        body = asyncio.get_running_loop().create_task(self._body(send))
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except BaseException:
            body.cancel()
            raise
        if not body.done():
            body.cancel()  # the client left before the end
        try:
            await body
        except asyncio.CancelledError:
            if not body.cancelled() or _cancelling():
                raise

    async def _body(self, send: Send) -> None:
        async with aclosing(self.chunks) as chunks:
            async for part in chunks:
                if not isinstance(part, bytes):  # as HttpResponseBase.make_bytes
                    part = (
                        bytes(part)
                        if isinstance(part, memoryview)
                        else str(part).encode(self.charset)
                    )
                if len(part) <= ASGIHandler.chunk_size:  # the one chunk of chunk_bytes
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                    continue
                for chunk, _ in ASGIHandler.chunk_bytes(part):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body"})
