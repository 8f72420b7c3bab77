"""Usage for a period, for cron and finance: the usage pages' table (one
source: ``ops_app.usage_report``), as text or CSV on stdout.

    manage.py lmsp_usage --from 2026-11-01 --to 2026-11-30 [--owner U] [--model M] \\
        [--by day|month] [--format table|csv]
    manage.py lmsp_usage --preset last_month --by month --format csv > november.csv
"""

from __future__ import annotations

from typing import Any

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from ops_app import usage_report


class Command(BaseCommand):
    help = "Print what each owner used of each model in a period (by UTC day or month)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--from", dest="from", help="first UTC day, e.g. 2026-11-01")
        parser.add_argument("--to", help="last UTC day, included (default: today)")
        parser.add_argument("--preset", choices=list(usage_report.PRESETS))
        parser.add_argument("--owner", help="a username: only this owner's usage")
        parser.add_argument("--model", help="only this model's usage")
        parser.add_argument("--by", choices=["day", "month"], default="day")
        parser.add_argument("--format", choices=["table", "csv"], default="table")

    def handle(self, *args: object, **options: Any) -> None:
        owner_id = None
        if options["owner"]:
            owner = get_user_model().objects.filter(username=options["owner"]).first()
            if owner is None:
                raise CommandError(f"No user named {options['owner']!r}.")
            owner_id = owner.pk
        try:
            filters = usage_report.filters_from(options, owner_id)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        usage = usage_report.report(filters)
        if options["format"] == "csv":
            usage_report.write_csv(usage, self.stdout)
        else:
            usage_report.write_table(usage, self.stdout)
