"""Container health checks for the processes that serve no HTTP (compose.yaml):

    manage.py lmsp_health worker   # a model worker on this host has a live heartbeat
    manage.py lmsp_health ops      # the sweeper (run by this ops worker's beat) is not stale

Exits 1 with the reason when unhealthy. The web process has ``GET /healthz``.
"""

from __future__ import annotations

import socket
from typing import Any

import redis
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ops_app import jobs
from tasks_app import heartbeat


def worker_alive(host: str) -> bool:
    """Celery names workers ``name@host``: one of this host's beats is live."""
    served = heartbeat.serving_workers()
    return any(beat.worker.endswith(f"@{host}") for beats in served.values() for beat in beats)


def sweeper_fresh() -> bool:
    return not next(h for h in jobs.job_health() if h.job == jobs.SWEEP).stale


class Command(BaseCommand):
    help = "Exit 0 when this container's model worker or ops worker is healthy."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("process", choices=["worker", "ops"])

    def handle(self, *args: object, **options: Any) -> None:
        try:
            if options["process"] == "worker":
                healthy = worker_alive(socket.gethostname())
                reason = "no live heartbeat from a model worker on this host"
            else:
                healthy = sweeper_fresh()
                reason = "the sweeper has not succeeded lately (is beat running?)"
        except redis.RedisError as exc:
            raise CommandError(f"Redis cannot be asked: {exc}") from exc
        if not healthy:
            raise CommandError(reason)
        self.stdout.write("healthy")
