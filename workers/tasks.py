"""Celery jobs: short shells around plain functions tested without Celery."""

from celery import shared_task
from celery.signals import worker_process_init

from tasks_app import lifecycle, retention

from . import runner


@shared_task(name="workers.tasks.run_task")
def run_task(task_id: str) -> str | None:
    return runner.run_task(task_id)


@shared_task(name="workers.tasks.sweep_tasks")
def sweep_tasks() -> dict:
    report = lifecycle.sweep()
    return {"requeued": report.requeued, "failed": report.failed, "resent": report.resent}


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
