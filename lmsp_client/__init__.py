"""A Python client for LMSP 1.0 services such as lmsp.

Usable alone: it depends on ``httpx`` and ``httpx-sse`` only and imports
nothing from the service. ``Client`` and ``AsyncClient`` have one method per
endpoint; ``follow`` reads a task's events across any number of dropped
connections, each event once and in order. The ``lmsp`` command
(``lmsp_client.cli``) is built on it.
"""

from ._common import Reconnect
from .aio import AsyncClient
from .client import Client
from .errors import ConnectionLostError, EventHistoryExpiredError, LMSPError, ProblemError
from .events import (
    DELTA_TYPES,
    EVENT_TYPES,
    ErrorEvent,
    Event,
    FunctionCallArgumentsDelta,
    OutputItemAdded,
    OutputItemDone,
    OutputTextDelta,
    ReasoningSummaryTextDelta,
    ResponseCancelled,
    ResponseCompleted,
    ResponseCreated,
    ResponseFailed,
    ResponseIncomplete,
    UnknownEvent,
    output_text,
    parse_event,
)

__all__ = [
    "DELTA_TYPES",
    "EVENT_TYPES",
    "AsyncClient",
    "Client",
    "ConnectionLostError",
    "ErrorEvent",
    "Event",
    "EventHistoryExpiredError",
    "FunctionCallArgumentsDelta",
    "LMSPError",
    "OutputItemAdded",
    "OutputItemDone",
    "OutputTextDelta",
    "ProblemError",
    "ReasoningSummaryTextDelta",
    "Reconnect",
    "ResponseCancelled",
    "ResponseCompleted",
    "ResponseCreated",
    "ResponseFailed",
    "ResponseIncomplete",
    "UnknownEvent",
    "output_text",
    "parse_event",
]
