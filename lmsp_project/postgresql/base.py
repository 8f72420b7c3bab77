"""Django's PostgreSQL backend, with a pool that forgets all its idle
connections at the first one found dead.

After a PostgreSQL restart every idle connection of a psycopg pool is dead.
Django's pool checks each one as it is borrowed, and psycopg then waits a
back-off before trying the next (1 s, 2 s, 4 s, ...), so a pool holding five
dead ones answered ``PoolTimeout`` after its 30 s, not a connection (seen in
the test process after a restart: the pool of a worker with a batch of
threads holds more). Here a failed check empties the pool (``drain``: the
idle connections closed and replaced, those in use closed when returned),
and the next try gets a new one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import cast

from django.db.backends.postgresql import base
from psycopg import Connection
from psycopg_pool import ConnectionPool

# A failed check after a drain is most likely another dead connection that
# was borrowed before it, not a new outage: drain at most this often.
DRAIN_AT_MOST_EVERY_SECONDS = 1.0


class DatabaseWrapper(base.DatabaseWrapper):
    @property
    def pool(self) -> ConnectionPool | None:
        pool = super().pool  # type: ignore[misc]  # django-stubs has no DatabaseWrapper.pool
        # Django passes its check when it creates the pool (CONN_HEALTH_CHECKS);
        # psycopg_pool keeps it in ``_check``, wrapped here once.
        if pool is not None and pool._check is not None:
            if not isinstance(pool._check, _DrainingCheck):
                pool._check = _DrainingCheck(pool, pool._check)
        return cast("ConnectionPool | None", pool)


class _DrainingCheck:
    """The pool's own check, draining the pool when it fails."""

    def __init__(self, pool: ConnectionPool, check: Callable[[Connection], None]) -> None:
        self._pool = pool
        self._check = check
        self._lock = threading.Lock()
        self._drained_at = 0.0

    def __call__(self, connection: Connection) -> None:
        try:
            self._check(connection)
        except Exception:
            with self._lock:
                due = time.monotonic() - self._drained_at >= DRAIN_AT_MOST_EVERY_SECONDS
                if due:
                    self._drained_at = time.monotonic()
            if due:
                self._pool.drain()
            raise
