"""Signed stream URLs: a task's event stream that a web page can open.

A browser's ``EventSource`` cannot send an ``Authorization`` header, so a
page cannot follow a task with its bearer token. Instead, an authenticated
request (``POST /lmsp/v1/tasks/{id}/stream-url``, scope ``tasks:read``)
gets a URL of the task's ordinary stream with an ``access`` parameter:
``/lmsp/v1/tasks/{id}/events?access=...``. The value is signed with the
service's secret key (``django.core.signing``, a salt of its own) and names
the task, the id of the token it was issued to, that token's owner and when
it expires (``LMSP_STREAM_URL_MINUTES`` after it was issued); it never holds
the token's secret or prefix.

Opening the URL authenticates as that token (``tasks_app.views``): the
token is read by its id and judged as a bearer token is, less the secret,
so a revoked or expired token, a deactivated owner, an erased task or
another task's path is refused as with the header (401, 404), and the
stream that opens is the token's: the same caps per token and owner, and
it ends when the token is revoked. The URL opens nothing else (read-only:
one task's events), and ``EventSource``'s reconnects send
``Last-Event-ID``, which the stream honours as for any client. Expiry is
checked when a stream opens: an open stream goes on, and a reconnect after
the expiry is refused (401), so a page asks for a new URL then.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

from django.conf import settings
from django.core import signing

from accounts_app.models import ApiToken
from lmsp_core.errors import unauthorized

from .selectors import task_not_found

PARAM = "access"
_SALT = "lmsp.tasks.stream-url"


@dataclass(frozen=True)
class StreamGrant:
    """What a valid signed URL lets its bearer open: ``task_id``'s events, as
    the token ``token_id`` of ``owner_id``."""

    task_id: str
    token_id: int
    owner_id: int


def issue(task_id: str, token: ApiToken, now: datetime) -> tuple[str, datetime]:
    """The signed URL of ``task_id``'s events for ``token``, and when it expires."""
    expires_at = now + timedelta(minutes=settings.LMSP_STREAM_URL_MINUTES)
    payload = {
        "task": task_id,
        "token": token.pk,
        "owner": token.owner_id,
        "exp": int(expires_at.timestamp()),
    }
    signed = signing.dumps(payload, salt=_SALT)
    return f"/lmsp/v1/tasks/{task_id}/events?{PARAM}={quote(signed)}", expires_at


def grant(signed: str, task_id: str, now: datetime) -> StreamGrant:
    """What ``signed`` (an ``access`` parameter) grants on ``task_id``'s
    stream: 401 when it is not one this service signed or has expired, 404
    when it was signed for another task (as an unknown task is)."""
    try:
        payload = signing.loads(signed, salt=_SALT)
    except signing.BadSignature:
        raise unauthorized("The stream URL is not valid; ask for a new one.") from None
    if datetime.fromtimestamp(payload["exp"], UTC) <= now:
        raise unauthorized("The stream URL has expired; ask for a new one.")
    if payload["task"] != task_id:
        raise task_not_found(task_id)
    return StreamGrant(payload["task"], payload["token"], payload["owner"])
