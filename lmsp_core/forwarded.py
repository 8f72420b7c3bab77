"""Forwarded headers (``X-Forwarded-Proto`` and the like, ``Forwarded``) only
from the proxies the settings name (``LMSP_TRUSTED_PROXIES``).

Why: behind a proxy that terminates TLS, Django takes ``X-Forwarded-Proto:
https`` as the request's scheme (``SECURE_PROXY_SSL_HEADER``), and with it
the admin's CSRF origins and secure cookies; any client that reaches the port
directly could claim https the same way. So a request from an address that is
not a trusted proxy loses these headers before anything reads them (this
middleware comes first). uvicorn is started with ``--no-proxy-headers``, so
that the address Django sees is the connection's own.
"""

from __future__ import annotations

from ipaddress import ip_address

from django.conf import settings
from django.http import HttpRequest
from django.utils.deprecation import MiddlewareMixin

FORWARDED = (
    "HTTP_FORWARDED",
    "HTTP_X_FORWARDED_PROTO",
    "HTTP_X_FORWARDED_HOST",
    "HTTP_X_FORWARDED_PORT",
    "HTTP_X_FORWARDED_FOR",
)


def from_trusted_proxy(address: str) -> bool:
    """Whether ``address`` (a request's ``REMOTE_ADDR``) is a trusted proxy's."""
    try:
        ip = ip_address(address)
    except ValueError:  # empty, a unix socket's path
        return False
    return any(ip in network for network in settings.LMSP_TRUSTED_PROXIES)


class TrustedProxyMiddleware(MiddlewareMixin):
    def process_request(self, request: HttpRequest) -> None:
        if not from_trusted_proxy(request.META.get("REMOTE_ADDR", "")):
            for name in FORWARDED:
                request.META.pop(name, None)
