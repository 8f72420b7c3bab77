"""Bearer authentication and per-view scopes: DRF's policy classes for the
API views. The async views DRF does not serve (direct responses, event
streams) judge the same token the same way (``services.verified_token``),
read on the streams' async pool (``tasks_app.event_reader.authenticated``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission

from .models import ApiToken
from .services import authenticate_bearer, require_scope

if TYPE_CHECKING:  # rest_framework.views imports this module through its settings
    from django.contrib.auth.models import User
    from rest_framework.request import Request
    from rest_framework.views import APIView


class BearerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request: Request) -> tuple[User, ApiToken]:
        token = authenticate_bearer(request.headers.get("Authorization"))
        return (token.owner, token)

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="lmsp"'


class HasRequiredScope(BasePermission):
    """Views name the scope each method needs in ``required_scopes``."""

    def has_permission(self, request: Request, view: APIView) -> bool:
        method = "GET" if request.method == "HEAD" else request.method
        scopes: dict[str, str] = cast(Any, view).required_scopes
        scope = scopes.get(method or "")
        if scope is not None:  # other methods are answered 405 by the view
            require_scope(cast(ApiToken, request.auth), scope)
        return True


def owner_of(request: Request) -> User:
    """The user whose bearer token authenticated ``request`` (the API views
    answer only authenticated requests: ``BearerTokenAuthentication``)."""
    return cast("User", request.user)
