"""Async reads of the event log for stream readers.

A stream can last for minutes. Under Django's ASGI handler every
``sync_to_async`` call of a request runs in that request's own thread with
its own database connection, which would then stay open for the stream's
whole life. Readers instead borrow a connection from one small async
psycopg pool per process for each short query.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from django.conf import settings
from django.db import connections
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from .event_log import StoredEvent

_pools: dict[asyncio.AbstractEventLoop, AsyncConnectionPool] = {}


@dataclass(frozen=True)
class TaskPosition:
    status: str
    last_event_id: int


def _conninfo() -> str:
    db = connections["default"].settings_dict
    options = {
        "dbname": db["NAME"],
        "user": db["USER"] or None,
        "password": db["PASSWORD"] or None,
        "host": db["HOST"] or None,
        "port": db["PORT"] or None,
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
        )
        _pools[loop] = pool
        await pool.open()
    return pool


async def read_after(task_id: str, after: int, limit: int = 500) -> list[StoredEvent]:
    pool = await _pool()
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT seq, type, data FROM tasks_app_event"
            " WHERE task_id = %s AND seq > %s ORDER BY seq LIMIT %s",
            (task_id, after, limit),
        )
        return [StoredEvent(*row) for row in await cursor.fetchall()]


async def position(task_id: str) -> TaskPosition | None:
    pool = await _pool()
    async with pool.connection() as conn:
        cursor = await conn.execute(
            "SELECT status, last_event_id FROM tasks_app_task WHERE id = %s", (task_id,)
        )
        row = await cursor.fetchone()
    return TaskPosition(*row) if row else None
