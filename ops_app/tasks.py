"""The operators' periodic jobs (the sweeper and the event pruner) and the
count of beat's start: Celery shells around plain functions tested without
Celery.

Why here and not in ``workers``: they keep the service's books, generate
nothing and run on the ops worker; ``workers.tasks`` holds only what a
model worker runs.
"""

from typing import Any

from celery import shared_task
from celery.signals import beat_init

from responses_app.retention import prune_history
from tasks_app import sweeper

from . import recorders


@shared_task(name="ops_app.tasks.sweep_tasks")
def sweep_tasks() -> dict[str, Any]:
    report = sweeper.sweep()
    recorders.job_succeeded("sweep_tasks")  # the admin and /metrics flag a stale sweeper
    return {
        "requeued": report.requeued,
        "ended": report.ended,
        "resent": report.resent,
        "failed": report.failed,
        "errors": report.errors,
    }


@shared_task(name="ops_app.tasks.prune_events")
def prune_events() -> int:
    pruned = prune_history()
    recorders.job_succeeded("prune_events")
    return pruned


@beat_init.connect
def jobs_scheduled(sender: Any, **_: object) -> None:  # celery's beat Service
    """Beat started: the periodic jobs' first runs are counted from now."""
    recorders.jobs_scheduled()
