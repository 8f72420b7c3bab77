"""The playground: a page of the service itself where a person chats with a
model, and whose answer survives a reload.

An app of its own, at the top of the layers beside ``ops_app``, because the
page is a client of the public API, not part of it: its script talks to
``/lmsp/v1/`` with a bearer token exactly as any program would (background
tasks, signed stream URLs for ``EventSource``, cancel), so that what it
shows is what the API gives. The server side is only the page (a template,
a stylesheet and a script under ``static/playground/``, served by the web
process with the admin's files: no CDN, no build step) and one sign-in for
the admin's session, which needs ``accounts_app`` to issue a token. It
imports nothing that loads the model (the web process never imports torch).
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils import timezone
from django.views.decorators.http import require_GET, require_POST

from accounts_app.services import issue_token
from lmsp_core.errors import ProblemError, problem_response

# What a token issued to an admin's session may do: chat, follow and cancel.
SESSION_SCOPES = ["models:read", "responses:read", "responses:write", "tasks:read", "tasks:write"]


@require_GET
def playground(request: HttpRequest) -> HttpResponse:
    """The page; it offers the session sign-in to a signed-in staff user."""
    user = request.user
    staff = user.is_authenticated and user.is_active and user.is_staff
    return render(request, "playground/index.html", {"staff": staff})


@require_POST
def session_token(request: HttpRequest) -> HttpResponse:
    """A bearer token for the signed-in staff user (the session's CSRF token
    required, as for any POST), expiring after
    ``LMSP_PLAYGROUND_TOKEN_MINUTES``; the page keeps it in the tab's
    session storage. 401 for anyone else."""
    user = request.user
    if not (user.is_authenticated and user.is_active and user.is_staff):
        return problem_response(
            ProblemError("unauthorized", "Sign in to the admin first, or use an API token.")
        )
    minutes = settings.LMSP_PLAYGROUND_TOKEN_MINUTES
    issued = issue_token(
        owner=user,
        scopes=SESSION_SCOPES,
        expires_in=minutes * 60,
        name="playground (admin session)",
    )
    expires_at = timezone.now() + timedelta(minutes=minutes)
    return JsonResponse(
        {"token": issued.secret, "username": user.get_username(), "expires_at": expires_at}
    )
