"""Floors for ``bench_fanout.py``: what one idle SSE connection costs a web
process before any lmsp stream code runs, so that the per-follower figures
can be read against them.

- ``bare``: a plain ASGI callable under uvicorn that sends one event and
  waits (the server, its HTTP parser and the socket alone);
- ``django``: the project's settings and middleware (this module is the
  settings module, see ``DJANGO_SETTINGS_MODULE``) with a URL configuration
  whose one async view answers a ``StreamingHttpResponse`` that sends one
  event and waits: Django's per-request overhead, without authentication,
  database or feeds; ``django-parked`` the same view letting go of the
  request's thread as a waiting stream does (``LMSP_FLOOR_PARK``);
- ``lean_app``: the same view and middleware served by
  ``lmsp_core.lean.LeanViews``, as follower streams are, without Django's
  request handler.
"""

from __future__ import annotations

import asyncio
import os

from lmsp_project.settings import *  # noqa: F403

ROOT_URLCONF = "fanout_floor"
FRAME = b'id: 1\nevent: response.created\ndata: {"status":"queued"}\n\n'


async def bare_app(scope: dict, receive, send) -> None:  # noqa: ANN001
    if scope["type"] != "http":
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    await send({"type": "http.response.body", "body": FRAME, "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass


async def _django_view(request, task_id: str):  # noqa: ANN001, ANN202
    from django.http import StreamingHttpResponse

    async def frames():  # noqa: ANN202
        yield FRAME
        if os.environ.get("LMSP_FLOOR_PARK"):  # as a waiting lmsp stream does
            from tasks_app.streams import _park_request_thread

            _park_request_thread()
        await asyncio.Event().wait()

    return StreamingHttpResponse(frames(), content_type="text/event-stream")


def __getattr__(name: str):  # noqa: ANN202 - built once Django is set up
    if name == "urlpatterns":
        from django.urls import path

        return [path("lmsp/v1/tasks/<str:task_id>/events", _django_view)]
    if name == "lean_app":
        from django.core.asgi import get_asgi_application

        from lmsp_core.lean import LeanViews

        django_app = get_asgi_application()
        return LeanViews(django_app, django_app, {_django_view: "GET"})
    raise AttributeError(name)
