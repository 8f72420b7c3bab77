"""Telling the web processes that a token no longer opens anything, so that
the streams it opened end within seconds (``tasks_app.stream_access``).

A stream is authorized once, when it opens; it can then last for hours. When
a token is revoked, expires early, or is deleted, or its owner is
deactivated or deleted, a message on Redis names it, sent once the change is
committed; every web process ends the matching streams it serves. Redis
only carries the news: a message lost (Redis down) or a change made without
one (an expiry that comes due, a row edited by hand) is caught by each
process's periodic check of the tokens of its open streams.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable

from django.contrib.auth.models import User
from django.db import transaction

from lmsp_core.redis_client import REDIS_ERRORS, redis_client

from .models import ApiToken

log = logging.getLogger(__name__)

CHANNEL = "lmsp:access"


def announce(tokens: Iterable[int] = (), owners: Iterable[int] = ()) -> None:
    """Say, once the current transaction commits, that these tokens, and every
    token of these owners, may no longer be used; a Redis outage is logged,
    never raised (the periodic check ends the streams instead)."""
    tokens, owners = list(tokens), list(owners)
    if not tokens and not owners:
        return
    message = json.dumps({"tokens": tokens, "owners": owners})
    transaction.on_commit(lambda: _publish(message))


def _publish(message: str) -> None:
    try:
        redis_client().publish(CHANNEL, message)
    except REDIS_ERRORS as exc:
        log.warning("Could not announce a revocation (%s): %s", message, exc)


# Receivers of the models' signals (connected in ``apps``): changes made in the
# admin or anywhere else are announced as well as ``services.revoke_token``'s.


def token_saved(sender: type, instance: ApiToken, **_: object) -> None:
    if not instance.is_active():
        announce(tokens=[instance.pk])


def token_deleted(sender: type, instance: ApiToken, **_: object) -> None:
    announce(tokens=[instance.pk])


def owner_saved(sender: type, instance: User, **_: object) -> None:
    if not instance.is_active:
        announce(owners=[instance.pk])


def owner_deleted(sender: type, instance: User, **_: object) -> None:
    announce(owners=[instance.pk])
