"""Celery jobs: short shells around plain functions tested without Celery."""

from celery import shared_task
from celery.signals import worker_process_init, worker_ready, worker_shutdown

from tasks_app import lifecycle, retention

from . import heartbeat, runner


@shared_task(name="workers.tasks.run_task")
def run_task(task_id: str) -> str | None:
    return runner.run_task(task_id)


@shared_task(name="workers.tasks.sweep_tasks")
def sweep_tasks() -> dict:
    report = lifecycle.sweep()
    return {"requeued": report.requeued, "ended": report.ended, "resent": report.resent}


@shared_task(name="workers.tasks.prune_events")
def prune_events() -> int:
    return retention.prune_events()


@worker_process_init.connect
def preload_models(**_: object) -> None:
    """Load this worker's models before the first job (solo pool: in the only
    process; prefork: in each child, never before the fork)."""
    from .loading import load_model
    from .registry import served_models

    for spec in served_models():
        load_model(spec)


_heartbeat: heartbeat.Heartbeat | None = None


@worker_ready.connect
def start_heartbeat(sender: object, **_: object) -> None:
    """Tell the admin which models this worker serves: those whose queue it
    consumes (the ops worker consumes none and beats for nothing)."""
    from .registry import declared_models

    global _heartbeat
    queues = set(sender.app.amqp.queues.consume_from)
    served = [spec.id for spec in declared_models().values() if spec.queue in queues]
    if served:
        _heartbeat = heartbeat.Heartbeat(served, sender.hostname)
        _heartbeat.start()


@worker_shutdown.connect
def stop_heartbeat(**_: object) -> None:
    if _heartbeat is not None:
        _heartbeat.stop()
