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
thread and no new PostgreSQL session, for all the followers connecting at
the same moment; ``accounts_app.services`` judges the token as it judges
any other. A signed stream URL's follower is read the same way, its token
named by id instead of prefix (``granted_token_and_task``). Requests that
start a generation authenticate the same way (``authenticated``).

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
from django.http import HttpRequest
from django.utils import timezone
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from accounts_app.models import ApiToken
from accounts_app.services import (
    bearer_credentials,
    require_scope,
    usable_token,
    use_to_record,
    verified_token,
)
from lmsp_core.errors import unauthorized
from lmsp_core.status import Status

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
    queue_rank: int | None = None  # read by ``positions`` only: its place while queued


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


# Where each of a set of tasks stands, and each queued one's exact place in
# its model's fair order (``fairness.FAIR_ORDER``), in one statement whatever
# their number: the queues of their models are read once, not once per task.
POSITIONS_SQL = """
WITH watched AS (
    SELECT id, model, status, last_event_id, pruned_through
      FROM tasks_app_task WHERE id = ANY(%(ids)s)
), ranked AS (
    SELECT id, row_number() OVER (PARTITION BY model ORDER BY fair_key, created_at, id) AS rank
      FROM tasks_app_task
     WHERE status = %(queued)s
       AND model IN (SELECT model FROM watched WHERE status = %(queued)s)
)
SELECT watched.id, status, last_event_id, pruned_through, rank
  FROM watched LEFT JOIN ranked USING (id)
"""


async def positions(task_ids: list[str]) -> dict[str, TaskPosition]:
    """Where each of these tasks stands (``position``) and, while queued, its
    place in its queue, in one query: the periodic check of every stream
    feed of a process (``tasks_app.streams``). A task that is gone is
    absent."""
    rows = await _run(POSITIONS_SQL, {"ids": task_ids, "queued": Status.QUEUED.value}, fetch="all")
    return {row[0]: TaskPosition(*row[1:]) for row in rows}


# Fields read by token_and_task, in the models' field order (Model.from_db).
TOKEN_FIELDS = (
    "id",
    "owner_id",
    "prefix",
    "secret_hash",
    "scopes",
    "allowed_models",
    "expires_at",
    "revoked_at",
    "last_used_at",
)
OWNER_FIELDS = ("id", "is_active")
TASK_FIELDS = ("id", "status", "last_event_id", "pruned_through")


# Followers connecting at the same time are looked up together, at most this
# many in one query.
LOOKUP_BATCH = 500


# How a follower names its token: by the prefix of the secret it sends, or
# (a signed stream URL, ``tasks_app.stream_urls``) by the token's id.
KEY_TYPES = {"prefix": "varchar", "id": "bigint"}


@functools.cache
def _token_and_task_sql(key: str) -> str:
    token = ", ".join(f"k.{name}" for name in TOKEN_FIELDS)
    task = ", ".join(f"t.{name}" for name in TASK_FIELDS)
    return (
        f"SELECT q.n, {token}, u.is_active, {task}"
        f" FROM unnest(%s::{KEY_TYPES[key]}[], %s::varchar[]) WITH ORDINALITY AS q(key, task_id, n)"
        f" JOIN {ApiToken._meta.db_table} k ON k.{key} = q.key"
        f" JOIN {get_user_model()._meta.db_table} u ON u.id = k.owner_id"
        f" LEFT JOIN {Task._meta.db_table} t"
        "  ON t.id = q.task_id AND t.owner_id = k.owner_id AND t.kind = %s"
    )


class _Lookups:
    """The lookups of one event loop's connecting followers. One query at a
    time reads all that are waiting (up to ``LOOKUP_BATCH``): each waits
    for at most the query before its own, and a burst of thousands of
    connections costs the database and this process dozens of queries, not
    thousands (a query's own cost, on the pool and in psycopg, was most of
    a lookup's time). ``key``: the token's column they name it by
    (``KEY_TYPES``)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.waiting: list[
            tuple[str | int, str | None, asyncio.Future[tuple[Any, ...] | None]]
        ] = []
        self.reading: asyncio.Task[None] | None = None

    def lookup(self, key: str | int, task_id: str | None) -> asyncio.Future[tuple[Any, ...] | None]:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((key, task_id, future))
        if self.reading is None:
            self.reading = loop.create_task(self._read(), name="lmsp-follower-lookups")
        return future

    async def _read(self) -> None:
        try:
            while self.waiting:
                batch = self.waiting[:LOOKUP_BATCH]
                del self.waiting[:LOOKUP_BATCH]
                try:
                    rows = await _run(
                        _token_and_task_sql(self.key),
                        ([b[0] for b in batch], [b[1] for b in batch], TaskKind.TASK),
                        fetch="all",
                    )
                except BaseException as exc:
                    for _, _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                    continue
                found = {row[0]: row[1:] for row in rows}
                for n, (_, _, future) in enumerate(batch, start=1):
                    if not future.done():  # its follower may have gone meanwhile
                        future.set_result(found.get(n))
        finally:
            self.reading = None


_lookups: dict[tuple[asyncio.AbstractEventLoop, str], _Lookups] = {}


async def token_and_task(prefix: str, task_id: str | None) -> tuple[ApiToken | None, Task | None]:
    """The token with ``prefix`` (with its owner's ``is_active``) and, when
    it is that owner's, the task ``task_id`` (a ``task``, not a direct
    generation; its id, status and event positions): one row of a query
    shared with the other followers connecting now (``_Lookups``). The
    instances hold only these fields: reading another would query the
    database synchronously."""
    return await _looked_up("prefix", prefix, task_id)


async def granted_token_and_task(
    token_id: int, task_id: str | None
) -> tuple[ApiToken | None, Task | None]:
    """``token_and_task`` for the token with id ``token_id`` (a signed stream
    URL's, ``tasks_app.stream_urls``)."""
    return await _looked_up("id", token_id, task_id)


async def _looked_up(
    key: str, value: str | int, task_id: str | None
) -> tuple[ApiToken | None, Task | None]:
    loop = asyncio.get_running_loop()
    lookups = _lookups.get((loop, key))
    if lookups is None:
        lookups = _lookups[loop, key] = _Lookups(key)
    row = await lookups.lookup(value, task_id)
    if row is None:
        return None, None
    token = ApiToken.from_db("default", TOKEN_FIELDS, row[: len(TOKEN_FIELDS)])
    token.owner = get_user_model().from_db(
        "default", OWNER_FIELDS, (token.owner_id, row[len(TOKEN_FIELDS)])
    )
    task_values = row[len(TOKEN_FIELDS) + 1 :]
    task = Task.from_db("default", TASK_FIELDS, task_values) if task_values[0] else None
    return token, task


async def record_token_use(token_id: int, now: datetime) -> None:
    """``accounts_app.services.authenticate_bearer``'s write of ``last_used_at``."""
    await _run(
        f"UPDATE {ApiToken._meta.db_table} SET last_used_at = %s WHERE id = %s",
        (now, token_id),
        fetch="none",
    )


async def judged_token(found: ApiToken | None, secret: str, scope: str) -> ApiToken:
    """The token ``token_and_task`` found for a secret, judged as
    ``accounts_app.services.authenticate_bearer`` judges it (401), its use
    recorded, and its ``scope`` required (403)."""
    now = timezone.now()
    return await _accepted(verified_token(found, secret, now), now, scope)


async def granted_token(found: ApiToken | None, owner_id: int, scope: str) -> ApiToken:
    """The token ``granted_token_and_task`` found for a signed stream URL,
    judged as ``judged_token`` judges one, less the secret the URL does not
    carry: it must still belong to ``owner_id`` and may be used now (401),
    its use is recorded, and it must carry ``scope`` (403)."""
    if found is None or found.owner_id != owner_id:
        raise unauthorized("The token this stream URL was issued to no longer exists.")
    now = timezone.now()
    return await _accepted(usable_token(found, now), now, scope)


async def _accepted(token: ApiToken, now: datetime, scope: str) -> ApiToken:
    if use_to_record(token, now):
        await record_token_use(token.pk, now)
    require_scope(token, scope)
    return token


async def authenticated(request: HttpRequest, scope: str) -> ApiToken:
    """The token the request's ``Authorization`` header names, which must
    carry ``scope`` (401, 403), read on this pool: an async view
    authenticates without a thread or a pooled session of its own, which for
    a request that starts a generation is on the way to its first token."""
    prefix, secret = bearer_credentials(request.headers.get("Authorization"))
    found, _ = await token_and_task(prefix, None)
    return await judged_token(found, secret, scope)


@functools.cache
def _usable_tokens_sql() -> str:
    return (
        "SELECT k.id, k.revoked_at, k.expires_at"
        f" FROM {ApiToken._meta.db_table} k"
        f" JOIN {get_user_model()._meta.db_table} u ON u.id = k.owner_id"
        " WHERE k.id = ANY(%s) AND u.is_active"
    )


async def usable_tokens(token_ids: list[int]) -> set[int]:
    """Which of these tokens may still be used now (not revoked, expired or
    deleted, and their owner active), judged as ``verified_token`` judges
    them: one query for the tokens of every stream a process serves
    (``tasks_app.stream_access``)."""
    rows = await _run(_usable_tokens_sql(), (token_ids,), fetch="all")
    now = timezone.now()
    fields = ("id", "revoked_at", "expires_at")
    return {row[0] for row in rows if ApiToken.from_db("default", fields, row).is_active(now)}


async def _run(sql: str, params: tuple[Any, ...] | dict[str, Any], fetch: str) -> Any:
    """One statement for requests that wait on it (``fetch``: "all" rows or
    "none"): a pooled connection that died with a PostgreSQL restart fails
    once, then the pool checks its connections and the statement runs
    again (a feed retries on its own)."""
    global QUERIES
    pool = await _pool()
    for attempt in (1, 2):
        try:
            async with pool.connection() as conn:
                QUERIES += 1
                cursor = await conn.execute(sql, params)
                # Not cursor.description: it builds column objects, which took
                # a third of a lookup's time.
                return await cursor.fetchall() if fetch == "all" else None
        except psycopg.OperationalError:
            if attempt == 2:
                raise
            await pool.check()
    return None
