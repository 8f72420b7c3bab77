"""The ASGI application: Django behind the body limit and upload timeout
(``lmsp_core.asgi.BoundedBody``), which act before Django reads a byte and
answer in the shape of the API the path belongs to.

In front of both, a few async views are served without Django's per-request
machinery (``lmsp_core.lean.LeanViews``: same resolver, middleware, views and
answers, the same bounded body, no thread per request): the views that follow
a task's or a background response's events, so that a web process holds
thousands of them, and direct responses (LMSP's and OpenAI's), whose first
token would wait for Django's handler. ``LMSP_LEAN_STREAMS=0`` hands them to
Django's handler like every other view.
"""

import gc
import os
from typing import cast

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

django_application = get_asgi_application()

from django.conf import settings  # noqa: E402

from generation.tokens import import_renderer, load_ready_tokenizers  # noqa: E402
from lmsp_core.asgi import ASGIApp, BoundedBody  # noqa: E402 - needs the settings configured
from lmsp_core.lean import LeanViews  # noqa: E402
from openai_app import views as openai_views  # noqa: E402
from openai_app.errors import error_body  # noqa: E402
from responses_app import views as response_views  # noqa: E402
from tasks_app import views as task_views  # noqa: E402

LEAN_VIEWS = {
    # The follower streams: thousands wait at once.
    task_views.task_events: "GET",  # /lmsp/v1/tasks/{id}/events
    openai_views.response_detail: "GET",  # /v1/responses/{id}
    # Direct responses: the handler's thread hops came before the first token.
    response_views.create_response: "POST",  # /lmsp/v1/responses
    openai_views.create_response: "POST",  # /v1/responses
    openai_views.chat_completions: "POST",  # /v1/chat/completions
}

# Imported and loaded now, not in the first request that renders a prompt.
import_renderer()
load_ready_tokenizers()

# Django's handler takes the ASGI mappings as mappings (django-stubs).
bounded = BoundedBody(cast(ASGIApp, django_application), shapes={"/v1/": error_body})
application = (
    LeanViews(bounded, django_application, LEAN_VIEWS) if settings.LMSP_LEAN_STREAMS else bounded
)

# What is loaded by now (Django, the apps and what they import: about 150,000
# objects) lives as long as the process. Frozen, the cyclic collector's full
# collections no longer walk it again each time the objects of open streams
# have grown by a quarter: while 5,000 followers connected, those pauses came
# to 0.6-0.7 s in all instead of 0.9-1.2 s (in-process probe).
gc.freeze()
# And a young generation of 50,000 objects instead of 700: each event woke
# every follower, whose new wait outlived the collections that ran meanwhile
# (one every 700 allocations), moved up and, every few seconds, set off a full
# collection of all the followers' objects. Sending 40 events to 5,000
# followers, that was three full collections pausing the process for up to
# 0.385 s (0.9 s in all), the largest part of the tail of the arrival spread;
# with 50,000, none (bench/README.md). Most garbage here is freed by its
# reference count anyway; the collector only finds cycles, a little later.
gc.set_threshold(50_000, *gc.get_threshold()[1:])
