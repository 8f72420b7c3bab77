"""Telling the model workers that an owner's words were erased, so that no
worker keeps them in its prefix cache (issue "Security III").

The database side of an erasure (a DELETE, retention, an owner deleted)
removes the rows; the workers hold the same words as cached keys and values,
salted by owner. Once the erasure commits, a message on Redis names the
owners whose text went away; every model worker drops the prefix-cache
entries of those owners (and, for a model whose cache is shared across
owners, every entry). A message lost while Redis is down is logged: the
entries then age out of the least-recently-used cache as usual.

Message: ``{"owners": [owner_id, ...]}`` on ``CHANNEL``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from django.db import transaction

from lmsp_core.redis_client import REDIS_ERRORS, redis_client

log = logging.getLogger(__name__)

CHANNEL = "lmsp:erasure"


def announce_erasure(owners: Iterable[int]) -> None:
    """Say, once the current transaction commits, that text of these owners was
    erased; a Redis outage is logged, never raised."""
    owner_ids = sorted(set(owners))
    if not owner_ids:
        return
    message = json.dumps({"owners": owner_ids})
    transaction.on_commit(lambda: _publish(message))


def parse(message: bytes | str) -> list[int]:
    """The owner ids a message names; an unreadable message names none."""
    try:
        owners = json.loads(message)["owners"]
    except (ValueError, KeyError, TypeError):
        log.warning("Ignoring an unreadable erasure message: %r", message)
        return []
    return [owner for owner in owners if isinstance(owner, int)]


def _publish(message: str) -> None:
    try:
        redis_client().publish(CHANNEL, message)
    except REDIS_ERRORS as exc:
        log.warning("Could not announce an erasure (%s): %s", message, exc)
