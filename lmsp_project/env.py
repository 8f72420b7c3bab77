"""Reading settings from the environment, without extra dependencies."""

import os
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return float(value) if value else default


def env_list(name: str, default: str = "") -> list[str]:
    """A comma-separated list; blanks around and empty entries dropped."""
    value = os.environ.get(name) or default
    return [entry.strip() for entry in value.split(",") if entry.strip()]


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if not value:
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def check_secret_key(key: str, builtin: str, *, development: bool) -> None:
    """Refuse to start anything but a development run with the key everyone
    knows: it signs the admin's sessions. A development run says so explicitly
    (``LMSP_DEVELOPMENT=1``), as scripts/serve and scripts/test do; DEBUG does
    not (a server started with LMSP_DEBUG=1 to look into a problem is still a
    server)."""
    if key == builtin and not development:
        from django.core.exceptions import ImproperlyConfigured

        raise ImproperlyConfigured(
            "LMSP_SECRET_KEY is not set: set it to a long random value (LMSP_DEBUG=1 needs one "
            "too), or LMSP_DEVELOPMENT=1 for a development run with the built-in key."
        )


def trusted_proxies(name: str) -> list[IPv4Network | IPv6Network]:
    """The addresses or networks (``10.0.0.5``, ``10.0.0.0/24``) in the
    comma-separated variable ``name``; ImproperlyConfigured naming a bad one."""
    networks = []
    for entry in env_list(name):
        try:
            networks.append(ip_network(entry, strict=False))
        except ValueError:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured(
                f"{name}: {entry!r} is not an IP address or network such as 10.0.0.0/24"
            ) from None
    return networks


def database_from_url(url: str, pool_size: int = 0) -> dict[str, Any]:
    """Django DATABASES entry for a ``postgresql://`` URL.

    A ``host`` query parameter names a unix socket folder, as libpq allows
    and as the embedded pgserver hands out. With ``pool_size`` > 0 the
    connections come from psycopg's pool (Django 5.1+): closing one, as
    ``lmsp_core.http.db_call`` and Celery do after each unit of work, hands it
    back to the pool instead of ending it.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"DATABASE_URL must be a postgresql:// URL, not {parts.scheme!r}")
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or ""])[0]
    return {
        "ENGINE": "lmsp_project.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": 0,  # the pool keeps connections; Django must not as well
        # A pooled connection that died with a PostgreSQL restart is replaced when borrowed.
        "CONN_HEALTH_CHECKS": bool(pool_size),
        "OPTIONS": {"pool": _pool_options(pool_size)} if pool_size else {},
    }


def _pool_options(size: int) -> dict[str, Any]:
    return {
        "min_size": 1,
        "max_size": size,
        "timeout": 30,
        # While PostgreSQL is down the pool retries a lost connection with a
        # growing back-off for up to this long (default 5 minutes), and can be
        # asleep in it when the server is back; given up after 2 s, the
        # connection is opened again when next borrowed.
        "reconnect_timeout": 2,
    }
