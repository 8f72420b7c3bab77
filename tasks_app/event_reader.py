"""Async reads of the event log for stream feeds.

A stream can last for minutes. Under Django's ASGI handler every
``sync_to_async`` call of a request runs in that request's own thread with
its own database connection, which would then stay open for the stream's
whole life. Feeds instead borrow a connection from one small async psycopg
pool per process for each short query, and these are the only queries a
stream makes after it has been admitted (see ``tasks_app.streams``).

``QUERIES`` counts them, so that a benchmark or a debugger can see what the
streams of this process cost the database.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import psycopg
import psycopg_pool
from django.conf import settings
from django.db import connections
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from .event_log import StoredEvent

_pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool] = {}

# What a read can fail with while PostgreSQL restarts or is unreachable:
# streams retry these, never pass them on.
READ_ERRORS: tuple[type[BaseException], ...] = (psycopg.Error, psycopg_pool.PoolTimeout, OSError)

QUERIES = 0  # statements sent by this process's stream reads


@dataclass(frozen=True)
class TaskPosition:
    status: str
    last_event_id: int
    pruned_through: int


def _conninfo() -> str:
    db = connections["default"].settings_dict
    options = {
        "dbname": db["NAME"],
        "user": db["USER"] or None,
        "password": db["PASSWORD"] or None,
        "host": db["HOST"] or None,
        "port": db["PORT"] or None,
        "application_name": "lmsp-streams",
    }
    return make_conninfo(**{key: value for key, value in options.items() if value})


async def _pool() -> AsyncConnectionPool:
    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is None:
        pool = AsyncConnectionPool(
            _conninfo(),
            min_size=1,
            max_size=settings.LMSP_STREAM_DB_POOL_SIZE,
            open=False,
            kwargs={"autocommit": True},
            # No check on borrowing (it would double the round trips): a
            # connection that died with a PostgreSQL restart fails one read,
            # which the feed retries, and the pool drops it.
            timeout=10,
        )
        _pools[loop] = pool
        await pool.open(wait=False)
    return pool


async def read_range(task_id: str, after: int, through: int | None = None) -> list[StoredEvent]:
    """Events with ``after < id <= through`` (or all later ones), oldest first."""
    global QUERIES
    pool = await _pool()
    async with pool.connection() as conn:
        QUERIES += 1
        if through is None:
            cursor = await conn.execute(
                "SELECT seq, type, data FROM tasks_app_event"
                " WHERE task_id = %s AND seq > %s ORDER BY seq",
                (task_id, after),
            )
        else:
            cursor = await conn.execute(
                "SELECT seq, type, data FROM tasks_app_event"
                " WHERE task_id = %s AND seq > %s AND seq <= %s ORDER BY seq",
                (task_id, after, through),
            )
        return [StoredEvent(*row) for row in await cursor.fetchall()]


async def position(task_id: str) -> TaskPosition | None:
    """Where the task's log stands, or None when the task is gone."""
    global QUERIES
    pool = await _pool()
    async with pool.connection() as conn:
        QUERIES += 1
        cursor = await conn.execute(
            "SELECT status, last_event_id, pruned_through FROM tasks_app_task WHERE id = %s",
            (task_id,),
        )
        row = await cursor.fetchone()
    return TaskPosition(*row) if row else None
