"""DRF glue: bearer authentication and per-view scopes."""

from rest_framework.authentication import BaseAuthentication
from rest_framework.permissions import BasePermission

from .services import authenticate_bearer, require_scope


class BearerTokenAuthentication(BaseAuthentication):
    def authenticate(self, request):  # noqa: ANN001
        token = authenticate_bearer(request.headers.get("Authorization"))
        return (token.owner, token)

    def authenticate_header(self, request) -> str:  # noqa: ANN001
        return 'Bearer realm="lmsp"'


class HasRequiredScope(BasePermission):
    """Views name the scope each method needs in ``required_scopes``."""

    def has_permission(self, request, view) -> bool:  # noqa: ANN001
        method = "GET" if request.method == "HEAD" else request.method
        scope = view.required_scopes.get(method)
        if scope is not None:  # other methods are answered 405 by the view
            require_scope(request.auth, scope)
        return True
