from django.core.management.base import BaseCommand, CommandError

from tasks_app.retention import prune_events


class Command(BaseCommand):
    help = "Remove the events of tasks that ended more than --older-than seconds ago."

    def add_arguments(self, parser) -> None:  # noqa: ANN001
        parser.add_argument(
            "--older-than",
            type=float,
            default=None,
            help="seconds since the task ended (default: LMSP_EVENT_RETENTION_SECONDS)",
        )

    def handle(self, *args, **options) -> None:  # noqa: ANN002, ANN003
        if options["older_than"] is not None and options["older_than"] < 0:
            raise CommandError("--older-than must be zero or more seconds")
        removed = prune_events(options["older_than"])
        self.stdout.write(f"Removed {removed} events.")
