"""Which tasks still have a message in the broker.

The sweeper re-sends the job of a task that has been queued a long time only
when its message is really gone (Redis restarted empty, a send that failed):
re-sending every long-queued task on every sweep would, behind a long
backlog, fill the queues with duplicates that each cost a worker a claim.

With Celery's Redis transport (kombu) a queue is a Redis list named after
it (plus one list per priority step), and a message a worker has taken but
not acknowledged yet (``acks_late``) waits in the ``unacked`` hash, with the
time it was taken in the ``unacked_index`` sorted set. Each message is a
JSON envelope whose base64 ``body`` holds the job's ``[args, kwargs,
embed]``; our jobs' first argument is the task id.

A taken message counts only while it is fresh. A live worker claims the
moment it takes a message (a job is a slot for its model, and a worker takes
no more messages than it has threads), so a task still queued long after
the message naming it was taken lost that message: its worker was killed
before the claim (the message then waits in ``unacked`` until the
visibility timeout, hours away), or the message was the slot through which
another task was claimed and no other is left for this one. Either way a
re-sent job is safe: a claim with nothing queued claims nothing.
"""

from __future__ import annotations

import base64
import functools
import json
import logging
from collections.abc import Iterable

import redis

from lmsp_core.celery_app import app as celery_app

log = logging.getLogger(__name__)

# kombu's Redis transport: priority steps and the separator of their list names.
PRIORITY_STEPS = (0, 3, 6, 9)
PRIORITY_SEP = "\x06\x16"
UNACKED = "unacked"
UNACKED_INDEX = "unacked_index"


@functools.cache
def _connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)


def _task_id(raw: bytes | str) -> str | None:
    """The task id a raw kombu message carries, or None for a foreign message."""
    try:
        envelope = json.loads(raw)
        if isinstance(envelope, list):  # an unacked entry: [message, exchange, routing key]
            envelope = envelope[0]
        body = envelope["body"]
        if envelope.get("properties", {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args = json.loads(body)[0]
        return args[0] if args and isinstance(args[0], str) else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def queue_lists(queue: str) -> list[str]:
    """The Redis lists that hold a queue's waiting messages, one per priority step."""
    return [queue if step == 0 else f"{queue}{PRIORITY_SEP}{step}" for step in PRIORITY_STEPS]


def task_ids_in_broker(queues: Iterable[str], taken_since: float) -> set[str] | None:
    """The task ids with a message waiting in these queues or taken (not yet
    acknowledged) at ``taken_since`` (a Unix time) or later; None when the
    broker cannot be read (then nothing is known to be lost, and a re-send
    would fail anyway)."""
    url = celery_app.conf.broker_url
    if not url or not str(url).startswith(("redis://", "rediss://", "unix://")):
        return None  # only the Redis transport is read (the only one this service runs)
    client = _connect(str(url))
    try:
        pipe = client.pipeline(transaction=False)
        for queue in sorted(set(queues)):
            for name in queue_lists(queue):
                pipe.lrange(name, 0, -1)
        pipe.zrangebyscore(UNACKED_INDEX, taken_since, "+inf")
        *waiting, fresh_tags = pipe.execute()
        fresh = client.hmget(UNACKED, fresh_tags) if fresh_tags else []
    except redis.RedisError as exc:
        log.warning("Could not read the broker's queues: %s", exc)
        return None
    found: set[str] = set()
    for raw in [*(raw for reply in waiting for raw in reply), *fresh]:
        task_id = _task_id(raw) if raw is not None else None  # acknowledged meanwhile: None
        if task_id is not None:
            found.add(task_id)
    return found
