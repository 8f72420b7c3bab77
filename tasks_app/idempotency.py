"""Idempotency keys (contract section 3): a retried POST never starts a
second generation."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
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


def _expiry_cutoff() -> timezone.datetime:
    return timezone.now() - timedelta(seconds=settings.LMSP_IDEMPOTENCY_TTL_SECONDS)


def start_once(owner: AbstractBaseUser, key: str, print_: str, start: Callable[[], Task]) -> Task:
    """The task for this key: started now by ``start`` or found from an earlier
    request."""
    IdempotencyKey.objects.filter(owner=owner, key=key, created_at__lt=_expiry_cutoff()).delete()
    try:
        with transaction.atomic():
            claim = IdempotencyKey.objects.create(owner=owner, key=key, fingerprint=print_)
    except IntegrityError:
        existing = IdempotencyKey.objects.select_related("task__response").get(owner=owner, key=key)
        if existing.fingerprint != print_:
            raise ProblemError(
                "idempotency_key_reused",
                f"{HEADER} {key!r} was already used with a different request.",
                param=HEADER,
            ) from None
        if existing.task is None:
            raise ProblemError(
                "idempotency_key_in_use",
                f"A request with {HEADER} {key!r} is still being accepted; retry shortly.",
                param=HEADER,
                headers={"Retry-After": "1"},
            ) from None
        return existing.task
    try:
        with transaction.atomic():
            task = start()
            IdempotencyKey.objects.filter(pk=claim.pk).update(task=task)
    except BaseException:
        claim.delete()  # refused or failed: the key is free again
        raise
    return task


def forget_expired() -> int:
    """Drop keys older than their TTL; what they kept for replays can then go
    (``responses_app.records.discard_unneeded``)."""
    return IdempotencyKey.objects.filter(created_at__lt=_expiry_cutoff()).delete()[0]
