"""Which models a caller may use: its owner's (``OwnerQuota.allowed_models``)
narrowed by its token's (``ApiToken.allowed_models``); None on either side
means no restriction there, so a deployment that sets neither is unchanged.

It lives here, beside the owner's quota row, because the token's app sits
below this one and the registry (``generation``) knows no owners: views and
the submit ask ``allowed_models`` and hand the set to
``generation.registry.get_model`` / ``listed_models``, which answer a model
outside it exactly as an unknown one (404 ``model_not_found``, and absent
from the lists), as the contract wants of what a caller may not see.
"""

from __future__ import annotations

from accounts_app.models import ApiToken

from .models import OwnerQuota


def intersect(*lists: list[str] | None) -> frozenset[str] | None:
    """The ids every given list allows; None when no list restricts."""
    allowed: frozenset[str] | None = None
    for ids in lists:
        if ids is not None:
            allowed = frozenset(ids) if allowed is None else allowed & frozenset(ids)
    return allowed


def owner_models(owner_id: int) -> list[str] | None:
    """The owner's own list (None: every model)."""
    found = OwnerQuota.objects.filter(owner_id=owner_id).values_list("allowed_models", flat=True)
    return next(iter(found), None)


def allowed_models(token: ApiToken) -> frozenset[str] | None:
    """The models a request authenticated by ``token`` may use (None: every one)."""
    return intersect(owner_models(token.owner_id), token.allowed_models)
