"""Idempotency keys (contract section 3): a retried POST never starts a
second generation.

A key is claimed (a row without a task) before the request is prepared, and
the claim gets its task in the same transaction that stores the task. A
claim whose request died in between is taken over after
``LMSP_IDEMPOTENCY_TAKEOVER_SECONDS``, so a crash never blocks a key for its
whole TTL.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.db import IntegrityError, transaction
from django.utils import timezone

from lmsp_core.errors import ProblemError

from .models import IdempotencyKey, Task

HEADER = "Idempotency-Key"


def parse_key(raw: str | None) -> str | None:
    """The header's key, or None; 1 to 255 printable ASCII characters."""
    if raw is None:
        return None
    if not 1 <= len(raw) <= 255 or not all(" " <= ch <= "~" for ch in raw):
        raise ProblemError(
            "invalid_request",
            f"{HEADER} must be 1 to 255 printable ASCII characters.",
            param=HEADER,
        )
    return raw


def fingerprint(endpoint: str, body: object) -> str:
    canonical = json.dumps([endpoint, body], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _expiry_cutoff() -> datetime:
    return timezone.now() - timedelta(seconds=settings.LMSP_IDEMPOTENCY_TTL_SECONDS)


class _ClaimLost(Exception):
    """Our claim was taken over while we were starting: undo what we started."""


def _in_use(key: str) -> ProblemError:
    return ProblemError(
        "idempotency_key_in_use",
        f"A request with {HEADER} {key!r} is still being accepted; retry shortly.",
        param=HEADER,
        headers={"Retry-After": "1"},
    )


def _claim(owner: User, key: str, print_: str) -> IdempotencyKey | Task:
    """Our claim on the key, or the task an earlier request started with it.

    A claim without a task older than ``LMSP_IDEMPOTENCY_TAKEOVER_SECONDS``
    belongs to a request that died before it could start anything (a killed
    process, a lost database connection): the next request takes it over,
    whatever its body, since nothing was accepted under the key. Its
    ``created_at`` is the claim's fence: the first request, should it still
    be alive, finds it changed and gives up what it started.
    """
    for _ in range(5):  # each turn loses a race to a request that then went away
        try:
            with transaction.atomic():
                return IdempotencyKey.objects.create(owner=owner, key=key, fingerprint=print_)
        except IntegrityError:
            pass
        existing = (
            IdempotencyKey.objects.select_related("task__response")
            .filter(owner=owner, key=key)
            .first()
        )
        if existing is None:
            continue  # the other claim was given up meanwhile: try ours again
        if existing.task is not None:
            if existing.fingerprint != print_:
                raise ProblemError(
                    "idempotency_key_reused",
                    f"{HEADER} {key!r} was already used with a different request.",
                    param=HEADER,
                )
            existing.task.replayed = True
            return existing.task
        takeover = timezone.now() - timedelta(seconds=settings.LMSP_IDEMPOTENCY_TAKEOVER_SECONDS)
        if existing.created_at >= takeover:
            if existing.fingerprint != print_:
                raise ProblemError(
                    "idempotency_key_reused",
                    f"{HEADER} {key!r} is in use by a different request.",
                    param=HEADER,
                )
            raise _in_use(key)
        now = timezone.now()
        taken = IdempotencyKey.objects.filter(
            pk=existing.pk, task__isnull=True, created_at=existing.created_at
        ).update(created_at=now, fingerprint=print_)
        if taken:
            existing.created_at, existing.fingerprint = now, print_
            return existing
    raise _in_use(key)


def start_once(owner: User, key: str, print_: str, start: Callable[[], Task]) -> Task:
    """The task for this key: started now by ``start`` or found from an earlier
    request; a found one has ``replayed`` set (its first request owns it: a
    replay must never cancel it)."""
    IdempotencyKey.objects.filter(owner=owner, key=key, created_at__lt=_expiry_cutoff()).delete()
    claim = _claim(owner, key, print_)
    if isinstance(claim, Task):
        return claim
    ours = IdempotencyKey.objects.filter(
        pk=claim.pk, task__isnull=True, created_at=claim.created_at
    )
    try:
        with transaction.atomic():
            task = start()
            if not ours.update(task=task):
                raise _ClaimLost
    except _ClaimLost:
        raise _in_use(key) from None  # a takeover went on with the key; this one stops
    except BaseException:
        ours.delete()  # refused or failed: the key is free again
        raise
    task.replayed = False
    return task


def forget_expired() -> int:
    """Drop keys older than their TTL; what they kept for replays can then go
    (``responses_app.records.discard_unneeded``)."""
    return IdempotencyKey.objects.filter(created_at__lt=_expiry_cutoff()).delete()[0]
