"""Where a task's job is sent: a conversation's next turn to the worker that
ran the turn before, whose prefix cache holds the conversation, so that only
the new message is computed; any other task to its model's queue, for any
worker.

It is a hint, never a requirement: the job goes to that worker's own queue
(``ModelSpec.worker_queue``) only while the worker beats for the model and
reported room for another generation (its heartbeat), and there its claim
takes that task first (``claims.claim``'s ``preferred``) if it is still
queued. A job stuck in the queue of a worker that died meanwhile is found
missing by the sweeper's broker check (which reads the models' queues only)
and sent to the model's queue after ``LMSP_REQUEUE_AFTER_SECONDS``.
"""

from __future__ import annotations

import logging

import redis

from generation.registry import ModelSpec

from . import heartbeat
from .models import Task

log = logging.getLogger(__name__)


def queue_for(spec: ModelSpec, follows: str | None) -> tuple[str, bool]:
    """The queue for a new task of ``spec`` continuing the response ``follows``
    (None: a new conversation), and whether it names one worker."""
    if follows is None:
        return spec.queue, False
    worker = Task.objects.filter(response_id=follows).values_list("worker", flat=True).first()
    if not worker:
        return spec.queue, False
    try:
        beat = heartbeat.beat_of(spec.id, worker)
    except redis.RedisError as exc:  # the job goes anywhere; sending it will say more
        log.debug("no routing hint for %s: %s", follows, exc)
        return spec.queue, False
    if beat is None or beat.engine.get("free_slots", 0) <= 0:
        return spec.queue, False
    return spec.worker_queue(worker), True
