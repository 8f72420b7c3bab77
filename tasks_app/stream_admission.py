"""Admission of event streams: each web process caps its open streams (in
all, per token, per owner) and refuses more with ``503 overloaded`` and
``Retry-After``, and lets itself hold as many sockets as the system allows.

Apart from the streams themselves (``tasks_app.streams``) because the
direct responses and the OpenAI routes admit their streams here too,
before they have a task to follow.
"""

from __future__ import annotations

import logging
import resource
import weakref
from collections.abc import AsyncGenerator, Callable
from typing import Any, TypeVar

from django.conf import settings

from lmsp_core.errors import ProblemError

log = logging.getLogger(__name__)

_open_streams = 0
_open_by_token: dict[object, int] = {}
_open_by_owner: dict[object, int] = {}


def admit(token_key: object, owner_key: object) -> Callable[[], None]:
    """Count a new stream against this process's caps (in all, per token, per
    owner), or refuse it with ``503 overloaded`` and ``Retry-After``. Returns
    the release function (safe to call more than once)."""
    global _open_streams
    per_token = _open_by_token.get(token_key, 0)
    per_owner = _open_by_owner.get(owner_key, 0)
    if _open_streams >= settings.LMSP_MAX_STREAMS_PER_PROCESS:
        raise _overloaded(
            f"This server process already serves {_open_streams} event streams; "
            "retry later or on another connection."
        )
    if per_token >= settings.LMSP_MAX_STREAMS_PER_TOKEN:
        raise _overloaded(
            f"This token already has {per_token} open event streams here "
            f"(at most {settings.LMSP_MAX_STREAMS_PER_TOKEN}); close one or retry later."
        )
    if per_owner >= settings.LMSP_MAX_STREAMS_PER_OWNER:
        raise _overloaded(
            f"Your tokens already have {per_owner} open event streams here "
            f"(at most {settings.LMSP_MAX_STREAMS_PER_OWNER}); close one or retry later."
        )
    _open_streams += 1
    _open_by_token[token_key] = per_token + 1
    _open_by_owner[owner_key] = per_owner + 1
    released = False

    def release() -> None:
        global _open_streams
        nonlocal released
        if released:
            return
        released = True
        _open_streams -= 1
        _count_down(_open_by_token, token_key)
        _count_down(_open_by_owner, owner_key)

    return release


def _count_down(counts: dict[object, int], key: object) -> None:
    left = counts.get(key, 1) - 1
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _overloaded(detail: str) -> ProblemError:
    seconds = settings.LMSP_STREAM_RETRY_AFTER_SECONDS
    return ProblemError("overloaded", detail, headers={"Retry-After": str(seconds)})


_Stream = TypeVar("_Stream", bound=AsyncGenerator[Any, None])


def admitted(stream: _Stream, release: Callable[[], None] | None) -> _Stream:
    """``stream`` (which calls ``release`` when it ends, or holds what does),
    made to give the admission back as well when it is dropped before it
    ever started (a client gone before the first byte)."""
    if release is not None:
        weakref.finalize(stream, release)
    return stream


def raise_open_file_limit() -> None:
    """Every stream holds a socket: let this process use all the descriptors
    the system allows it, not the 1024 of a default soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1_048_576)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            log.warning("Could not raise the open-file limit from %s to %s", soft, target)
