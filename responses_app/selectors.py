"""Reads of responses."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import User
from django.db.models import QuerySet

from lmsp_core.errors import ProblemError
from lmsp_core.ids import is_valid_id

from .models import Response


def stored_response(owner: User, response_id: str, param: str | None = None) -> Response:
    """A response kept with ``store: true`` by this owner, else 404 (never 403)."""
    response = None
    if is_valid_id(response_id, "resp"):  # anything else, NUL included, is not looked up
        response = Response.objects.filter(id=response_id, owner=owner, store=True).first()
    if response is None:
        raise _not_found("stored response", response_id, param)
    return response


def erasable_responses(
    owner: User, response_id: str, param: str | None = None
) -> QuerySet[Response]:
    """The response ``DELETE /responses/{id}`` erases, as a query: any of this
    owner's that is still kept, stored or not, a task's result or a direct
    answer (an unstored one lives on while it runs, and for its
    ``Idempotency-Key``'s retries); else 404, never 403."""
    found = Response.objects.none()
    if is_valid_id(response_id, "resp"):
        found = Response.objects.filter(id=response_id, owner=owner)
    if not found.exists():
        raise _not_found("response", response_id, param)
    return found


def _not_found(what: str, response_id: str, param: str | None) -> ProblemError:
    shown = response_id if len(response_id) <= 64 else response_id[:64] + "..."
    return ProblemError("response_not_found", f"No {what} with id {shown!r}.", param=param)


def conversation_chain(response: Response) -> list[Response]:
    """The responses a conversation went through, first turn first, ending with ``response``."""
    chain = []
    turn: Response | None = response
    while turn is not None:
        chain.append(turn)
        turn = turn.previous_response
    return chain[::-1]


def conversation_items(response: Response) -> list[dict[str, Any]]:
    """The whole context a response continued from, then its own input and output."""
    return [item for turn in conversation_chain(response) for item in turn.input + turn.output]
