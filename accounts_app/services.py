"""Creating, revoking and checking API tokens."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, cast

from django.contrib.auth import get_user_model
from django.contrib.auth.models import User
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Field
from django.utils import timezone

from lmsp_core.errors import ProblemError, unauthorized

from . import revocation
from .models import RESERVED_SCOPES, SCOPES, ApiToken

TOKEN_PREFIX = "lmsp"
PREFIX_LENGTH = 12  # hex characters: the public part of a token, as revoke names it
# last_used_at is written at most this often per token, not on every request.
LAST_USED_RESOLUTION = timedelta(seconds=60)


@dataclass(frozen=True)
class IssuedToken:
    token: ApiToken
    secret: str  # shown once, never stored


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse_scopes(raw: str | list[str]) -> list[str]:
    scopes = [s.strip() for s in raw.split(",")] if isinstance(raw, str) else list(raw)
    scopes = [s for s in scopes if s]
    for scope in scopes:
        if scope in RESERVED_SCOPES:
            raise ValueError(f"scope {scope!r} is reserved and cannot be granted")
        if scope not in SCOPES:
            raise ValueError(f"unknown scope {scope!r}; known: {', '.join(SCOPES)}")
    return sorted(set(scopes))


def valid_username(username: str) -> str:
    """``username`` if the user model accepts it as the admin's forms do
    (Django's username validator: letters, digits and ``@.+-_``, at most 150
    characters); else ValueError saying why."""
    model = get_user_model()
    field = cast("Field[Any, Any]", model._meta.get_field(model.USERNAME_FIELD))
    try:
        return str(field.clean(username, None))
    except ValidationError as error:
        raise ValueError(f"user name {username!r}: {' '.join(error.messages)}") from None


@transaction.atomic
def create_token(
    *,
    username: str,
    scopes: list[str] | str,
    expires_in: int | None = None,
    name: str = "",
) -> IssuedToken:
    user, _ = get_user_model().objects.get_or_create(username=valid_username(username))
    return issue_token(owner=user, scopes=parse_scopes(scopes), expires_in=expires_in, name=name)


def issue_token(
    *,
    owner: User,
    scopes: list[str],
    expires_in: int | None = None,
    name: str = "",
    allowed_models: list[str] | None = None,
) -> IssuedToken:
    prefix = secrets.token_hex(PREFIX_LENGTH // 2)
    secret = f"{TOKEN_PREFIX}_{prefix}_{secrets.token_urlsafe(32)}"
    expires_at = timezone.now() + timedelta(seconds=expires_in) if expires_in else None
    token = ApiToken.objects.create(
        owner=owner,
        name=name,
        prefix=prefix,
        secret_hash=_hash(secret),
        scopes=parse_scopes(scopes),
        allowed_models=allowed_models,
        expires_at=expires_at,
    )
    return IssuedToken(token=token, secret=secret)


def revoke_token(prefix: str) -> int:
    """Revoke the token with this whole prefix (or the whole secret, whose second
    part is the prefix); returns how many were revoked, 0 or 1.

    Only a whole prefix names a token: a part of one could name several, and
    an operator revoking one token must never revoke others by accident.
    """
    prefix = prefix.strip().removeprefix(f"{TOKEN_PREFIX}_").split("_", 1)[0]
    if len(prefix) != PREFIX_LENGTH:
        return 0
    with transaction.atomic():
        token_ids = list(
            ApiToken.objects.select_for_update()
            .filter(prefix=prefix, revoked_at__isnull=True)
            .values_list("id", flat=True)
        )
        ApiToken.objects.filter(id__in=token_ids).update(revoked_at=timezone.now())
        revocation.announce(tokens=token_ids)  # its open streams end
    return len(token_ids)


def bearer_credentials(header: str | None) -> tuple[str, str]:
    """The prefix and the whole secret of an ``Authorization: Bearer`` header,
    or 401: what can be checked before the token is looked up."""
    if not header:
        raise unauthorized("The Authorization header is missing; send 'Bearer <token>'.")
    scheme, _, secret = header.partition(" ")
    secret = secret.strip()
    if scheme.lower() != "bearer" or not secret:
        raise unauthorized("The Authorization header must be 'Bearer <token>'.")
    parts = secret.split("_", 2)
    if len(parts) != 3 or parts[0] != TOKEN_PREFIX:
        raise unauthorized("The bearer token is not valid.")
    return parts[1], secret


def verified_token(token: ApiToken | None, secret: str, now: datetime) -> ApiToken:
    """The token found by the secret's prefix (its owner loaded), if the secret
    is its own and it may be used ``now``; else 401."""
    if token is None or not hmac.compare_digest(token.secret_hash, _hash(secret)):
        raise unauthorized("The bearer token is not valid.")
    return usable_token(token, now)


def usable_token(token: ApiToken, now: datetime) -> ApiToken:
    """``token`` (its owner loaded) if it may be used ``now``; else 401. What
    a signed stream URL (``tasks_app.stream_urls``) asks of the token it was
    issued to, since it carries no secret to check."""
    if not token.is_active(now):
        raise unauthorized("The bearer token has expired or was revoked.")
    if not token.owner.is_active:
        # A deactivated account keeps its tokens (reactivation restores them)
        # but none of them opens anything meanwhile.
        raise unauthorized("The account of this bearer token is deactivated.")
    return token


def use_to_record(token: ApiToken, now: datetime) -> bool:
    """Whether this use of the token is to be written to ``last_used_at``."""
    return token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION


def authenticate_bearer(header: str | None) -> ApiToken:
    """The active token named by an ``Authorization: Bearer`` header, or 401."""
    prefix, secret = bearer_credentials(header)
    found = ApiToken.objects.select_related("owner").filter(prefix=prefix).first()
    now = timezone.now()
    token = verified_token(found, secret, now)
    if use_to_record(token, now):
        ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
    return token


def require_scope(token: ApiToken, scope: str) -> None:
    if scope not in token.scopes:
        raise ProblemError(
            "insufficient_scope", f"This endpoint needs the {scope!r} scope.", scope=scope
        )
