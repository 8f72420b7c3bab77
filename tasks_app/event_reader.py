"""Async reads of the event log for stream feeds, and what a new follower
needs: its token and its task, in one query.

A stream can last for minutes. Under Django's ASGI handler every
``sync_to_async`` call of a request runs in that request's own thread with
its own database connection, which would then stay open for the stream's
whole life. Feeds instead borrow a connection from one small async psycopg
pool per process for each short query, and these are the only queries a
stream makes after it has been admitted (see ``tasks_app.streams``).

Connecting a follower borrows the same pool: one query reads the bearer
token, its owner's ``is_active`` and the task (``token_and_task``), with no
thread and no new PostgreSQL session; ``accounts_app.services`` judges the
token as it judges any other.

``QUERIES`` counts them, so that a benchmark or a debugger can see what the
streams of this process cost the database.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
import psycopg_pool
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connections
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from accounts_app.models import ApiToken

from .event_log import StoredEvent
from .models import Task, TaskKind

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


# Fields read by token_and_task, in the models' field order (Model.from_db).
TOKEN_FIELDS = (
    "id",
    "owner_id",
    "prefix",
    "secret_hash",
    "scopes",
    "expires_at",
    "revoked_at",
    "last_used_at",
)
OWNER_FIELDS = ("id", "is_active")
TASK_FIELDS = ("id", "status", "last_event_id", "pruned_through")


@functools.cache
def _token_and_task_sql() -> str:
    token = ", ".join(f"k.{name}" for name in TOKEN_FIELDS)
    task = ", ".join(f"t.{name}" for name in TASK_FIELDS)
    return (
        f"SELECT {token}, u.is_active, {task}"
        f" FROM {ApiToken._meta.db_table} k"
        f" JOIN {get_user_model()._meta.db_table} u ON u.id = k.owner_id"
        f" LEFT JOIN {Task._meta.db_table} t"
        "  ON t.id = %s AND t.owner_id = k.owner_id AND t.kind = %s"
        " WHERE k.prefix = %s"
    )


async def token_and_task(prefix: str, task_id: str | None) -> tuple[ApiToken | None, Task | None]:
    """The token with ``prefix`` (with its owner's ``is_active``) and, when
    it is that owner's, the task ``task_id`` (a ``task``, not a direct
    generation; its id, status and event positions), in one query. The
    instances hold only these fields: reading another would query the
    database synchronously."""
    row = await _fetch_one(_token_and_task_sql(), (task_id, TaskKind.TASK, prefix))
    if row is None:
        return None, None
    token_values = row[: len(TOKEN_FIELDS)]
    token = ApiToken.from_db("default", TOKEN_FIELDS, token_values)
    token.owner = get_user_model().from_db(
        "default", OWNER_FIELDS, (token.owner_id, row[len(TOKEN_FIELDS)])
    )
    task_values = row[len(TOKEN_FIELDS) + 1 :]
    task = Task.from_db("default", TASK_FIELDS, task_values) if task_values[0] else None
    return token, task


async def record_token_use(token_id: int, now: datetime) -> None:
    """``accounts_app.services.authenticate_bearer``'s write of ``last_used_at``."""
    await _fetch_one(
        f"UPDATE {ApiToken._meta.db_table} SET last_used_at = %s WHERE id = %s", (now, token_id)
    )


async def _fetch_one(sql: str, params: tuple) -> tuple[Any, ...] | None:
    """One statement for a request that waits on it: a pooled connection that
    died with a PostgreSQL restart fails once, then the pool checks its
    connections and the statement runs again (a feed retries on its own)."""
    global QUERIES
    pool = await _pool()
    for attempt in (1, 2):
        try:
            async with pool.connection() as conn:
                QUERIES += 1
                cursor = await conn.execute(sql, params)
                return await cursor.fetchone() if cursor.description else None
        except psycopg.OperationalError:
            if attempt == 2:
                raise
            await pool.check()
    return None
