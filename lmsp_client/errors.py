"""Exceptions of the LMSP client.

The service answers every error with an RFC 9457 problem document; the
client raises it as ``ProblemError`` with the document's members as
attributes and the whole document kept, so callers can branch on ``code``.
A pruned event history (``410 event_history_expired``) has its own class
because the caller's next step is different: the events are gone for good,
and the result has to be fetched from the task instead.
"""

from __future__ import annotations

from typing import Any


class LMSPError(Exception):
    """Every error this client raises."""


class ProblemError(LMSPError):
    """An error answer of the service, carrying its problem document."""

    def __init__(self, problem: dict[str, Any], *, http_status: int | None = None) -> None:
        self.problem = dict(problem)
        status = self.problem.get("status")
        self.status: int | None = status if isinstance(status, int) else http_status
        self.code: str | None = self.problem.get("code")
        self.title: str | None = self.problem.get("title")
        self.detail: str | None = self.problem.get("detail")
        self.param: str | None = self.problem.get("param")
        self.type: str | None = self.problem.get("type")
        super().__init__(self._message())

    def _message(self) -> str:
        head = f"{self.status} {self.code or self.title or 'error'}"
        text = f"{head}: {self.detail}" if self.detail else head
        return f"{text} (param {self.param})" if self.param else text


class EventHistoryExpiredError(ProblemError):
    """``410 event_history_expired``: the events after the resume point were
    removed by retention. ``first_available_event_id`` is the oldest event
    still kept (``None`` when none is); the task itself, with its final
    result, is at ``task_url`` (its status is ``task_status``)."""

    def __init__(
        self, problem: dict[str, Any], *, http_status: int | None = None, after: int | None = None
    ) -> None:
        self.first_available_event_id: int | None = problem.get("first_available_event_id")
        self.task_status: str | None = problem.get("task_status")
        self.task_url: str | None = problem.get("task_url")
        self.after = after
        super().__init__(problem, http_status=http_status)

    @property
    def task_id(self) -> str | None:
        return self.task_url.rstrip("/").rsplit("/", 1)[-1] if self.task_url else None

    def _message(self) -> str:
        start = "the first" if self.after is None else str(self.after + 1)
        if self.first_available_event_id is None:
            gone = f"events from {start} on were removed by retention (none is kept)"
        else:
            gone = (
                f"events from {start} to {self.first_available_event_id - 1} were removed "
                f"by retention (the oldest kept is {self.first_available_event_id})"
            )
        return f"{gone}; the task is {self.task_status}, its result is at {self.task_url}"


class ConnectionLostError(LMSPError):
    """``follow`` gave up: the service stayed unreachable past the reconnect
    limit. ``last_event_id`` is the last event delivered, to resume from."""

    def __init__(self, message: str, *, last_event_id: int) -> None:
        self.last_event_id = last_event_id
        super().__init__(message)


def problem_error(
    problem: dict[str, Any], http_status: int, after: int | None = None
) -> ProblemError:
    """The exception for an error answer."""
    if problem.get("code") == "event_history_expired":
        return EventHistoryExpiredError(problem, http_status=http_status, after=after)
    return ProblemError(problem, http_status=http_status)
