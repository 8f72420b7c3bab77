"""Reading settings from the environment, without extra dependencies."""

import os
from urllib.parse import parse_qs, unquote, urlsplit


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value in (None, "") else int(value)


def env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    return default if value in (None, "") else float(value)


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value in (None, ""):
        return default
    return value.strip().lower() in {"1", "true", "yes", "on"}


def database_from_url(url: str) -> dict:
    """Django DATABASES entry for a ``postgresql://`` URL.

    A ``host`` query parameter names a unix socket folder, as libpq allows
    and as the embedded pgserver hands out.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"}:
        raise ValueError(f"DATABASE_URL must be a postgresql:// URL, not {parts.scheme!r}")
    query = parse_qs(parts.query)
    host = query.get("host", [parts.hostname or ""])[0]
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": unquote(parts.path.lstrip("/")) or "postgres",
        "USER": unquote(parts.username or ""),
        "PASSWORD": unquote(parts.password or ""),
        "HOST": host,
        "PORT": str(parts.port or ""),
        "CONN_MAX_AGE": 0,
        "OPTIONS": {},
    }
