from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from responses_app.retention import prune_history


class Command(BaseCommand):
    help = (
        "Remove the events of tasks that ended more than --older-than seconds ago, then "
        "idempotency keys past their TTL, store:false responses nobody can fetch any more, "
        "stored responses past LMSP_RESPONSE_RETENTION_DAYS, and tasks past "
        "LMSP_TASK_RETENTION_SECONDS."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than",
            type=float,
            default=None,
            help="seconds since the task ended (default: LMSP_EVENT_RETENTION_SECONDS)",
        )

    def handle(self, *args: Any, **options: Any) -> None:
        if options["older_than"] is not None and options["older_than"] < 0:
            raise CommandError("--older-than must be zero or more seconds")
        removed = prune_history(options["older_than"])
        self.stdout.write(f"Removed {removed} events.")
