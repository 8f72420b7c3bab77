"""The one synchronous Redis client of a process (publishing, heartbeats)."""

import functools

import redis
from django.conf import settings


@functools.cache
def _connect(url: str) -> redis.Redis:
    # Short timeouts: callers treat Redis as a wake-up channel and carry on
    # (logging) when it is away, so none of them may hang on it.
    return redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)


def redis_client() -> redis.Redis:
    """A client for ``settings.REDIS_URL`` (read each call: tests point it elsewhere)."""
    return _connect(settings.REDIS_URL)


# What a Redis call of a process that carries on without it catches: besides
# Redis's own errors, a connection broken under one of a worker's threads
# surfaces from redis-py's socket reader as OSError or ValueError (seen after
# a worker restart, where it failed the generations that pushed their token
# counts).
REDIS_ERRORS: tuple[type[BaseException], ...] = (redis.RedisError, OSError, ValueError)
