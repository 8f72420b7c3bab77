"""A model worker's Celery job and signals: short shells around plain
functions tested without Celery (the ops jobs are ``ops_app.tasks``)."""

import gc
import logging
import threading
import time
from typing import Any

from celery import shared_task
from celery.signals import worker_ready, worker_shutdown, worker_shutting_down
from django.conf import settings

from ops_app import recorders
from tasks_app import heartbeat

log = logging.getLogger(__name__)


@shared_task(name="workers.tasks.run_task")
def run_task(task_id: str, model: str | None = None, preferred: bool = False) -> str | None:
    # Imported here: the ops worker registers this job too (the app finds
    # every app's jobs) but never runs it, and the runner brings torch,
    # transformers and xgrammar (2-3 s of each of its starts with their bytecode
    # cached, 5 s compiling it, and their memory).
    from . import runner

    return runner.run_task(task_id, model=model, preferred=preferred)


_heartbeat: heartbeat.Heartbeat | None = None


@worker_ready.connect
def serve_models(sender: Any, **_: object) -> None:  # celery's WorkController
    """Load the models whose queues this worker consumes and start their
    batching engines before the first job, then tell the admin it serves them
    (the ops worker consumes none; ``workers.serve`` has started the grammar
    compiler's fork server meanwhile). Erasures are heard from the start
    (``erasure``).

    Model workers run the threads pool, so this is the process that generates;
    with a prefork pool the weights would be loaded before the fork, which
    CUDA does not survive."""
    from generation.registry import available_models

    global _heartbeat
    queues = set(sender.app.amqp.queues.consume_from)
    served = [spec for spec in available_models().values() if spec.queue in queues]
    if not served:
        return  # the ops worker: it loads no model, nor torch
    from engine.client import engine_for

    from . import erasure, upstream
    from .loading import load_model

    erasure.listen()
    for spec in served:
        if spec.upstream is not None:  # no weights here: the tokenizer and the client
            upstream.upstream_engine(upstream.load_upstream(spec).spec)
            upstream.watch_health(spec)
        else:
            engine_for(load_model(spec), spec.max_batch)
    # What is loaded by now (torch, transformers, the tokenizers, Django: 460
    # thousand objects with one small model) lives as long as the process:
    # the collector leaves it be from now on. Else each full collection
    # walked it all (0.24 s with the GIL held, a pause in every stream) and
    # so did the exit (1.3 s idle, 3-5 s beside a successor's start: a
    # drained worker exited after 15.1 s where its drain had ended at 10).
    gc.freeze()
    # Beating says the models are loaded: a draining worker hands its
    # generations over to this one from now on.
    _heartbeat = heartbeat.Heartbeat([spec.id for spec in served], sender.hostname, EngineReport())
    _heartbeat.start()


class EngineReport:
    """What a model's engine holds now, for its heartbeat (the gauges of
    ``/metrics``); its counts since the last beat go to Redis meanwhile."""

    def __init__(self) -> None:
        self._counted: dict[str, dict[str, int]] = {}

    def __call__(self, model_id: str) -> dict[str, int]:
        from engine.client import engine_for
        from generation.registry import available_models

        from . import upstream
        from .loading import load_model

        spec = available_models()[model_id]
        if spec.upstream is not None:
            client = upstream.upstream_engine(spec)
            return {"free_slots": spec.max_batch - client.running - client.waiting}
        stats = engine_for(load_model(spec), spec.max_batch).stats()
        counts = {name: getattr(stats.counts, name) for name in recorders.ENGINE_COUNTS}
        before = self._counted.get(model_id, dict.fromkeys(counts, 0))
        recorders.add_engine_counts(model_id, {k: v - before[k] for k, v in counts.items()})
        self._counted[model_id] = counts
        return {
            "token_budget": stats.token_budget,
            "tokens_in_use": stats.held_tokens,
            "cache_tokens": stats.cached_tokens,
            "cache_entries": stats.cache_entries,
            # room for a conversation's next turn (tasks_app.routing)
            "free_slots": spec.max_batch - stats.running - stats.waiting,
        }


@worker_shutting_down.connect
def drain(**_: object) -> None:
    """SIGTERM (or Ctrl-C): Celery stops taking jobs and waits for the running
    ones; this makes them end soon. The worker stops beating (no follow-up is
    routed here, its readiness goes), and once another worker beats for each
    model it serves, or after ``LMSP_DRAIN_WAIT_SECONDS``, its engines preempt
    every generation: each job writes its checkpoint and hands its task back
    to the queue, first in the fair order, for another worker to continue
    (``checkpoints.hand_back``). Until then its generations go on, on half its
    threads (``BatchingEngine.share_cores``), so that a rolling deploy's new
    worker, started at the same moment, takes them over with no wait longer
    than its own start. The ops worker serves no model: nothing to do."""
    if _heartbeat is None:
        return
    threading.Thread(target=_hand_over, args=(_heartbeat,), name="lmsp-drain", daemon=True).start()


def _hand_over(beating: heartbeat.Heartbeat) -> None:
    from engine.client import drain_all, engines

    beating.stop()
    for engine in engines():
        engine.share_cores()
    deadline = time.monotonic() + settings.LMSP_DRAIN_WAIT_SECONDS
    while time.monotonic() < deadline:
        if not any(engine.running or engine.waiting for engine in engines()):
            break  # nothing to hand over
        if heartbeat.served_elsewhere(beating.model_ids, beating.worker):
            break
        time.sleep(0.2)
    log.warning("Draining: handing every generation back to the queue")
    drain_all()


@worker_shutdown.connect
def stop_heartbeat(**_: object) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()
