"""Existing deployments show their history on the usage pages: the usage
records stored before 0007 get their worker seconds from their tasks (where
the tasks still exist: an estimate, from the task's start to its end, since
nothing measured their time in the engine then), and DailyUsage is rebuilt from every ended
usage record (a record still in progress is added when it ends). The SQL is
written out here rather than imported, so this migration keeps doing what it
did when the code moves on."""

from django.db import migrations

WORKER_SECONDS_SQL = """
UPDATE tasks_app_usagerecord AS record
   SET worker_seconds = greatest(0, extract(epoch FROM task.completed_at - task.started_at))
  FROM tasks_app_task AS task
 WHERE task.response_id = record.response_id AND record.status <> 'in_progress'
   AND task.started_at IS NOT NULL AND task.completed_at IS NOT NULL
   AND record.worker_seconds = 0
"""

DAILY_USAGE_SQL = """
INSERT INTO tasks_app_dailyusage AS daily
       (owner_id, model, day, requests, input_tokens, output_tokens, cached_tokens, worker_seconds)
SELECT owner_id, model, (created_at AT TIME ZONE 'UTC')::date, count(*), sum(input_tokens),
       sum(output_tokens), sum(cached_tokens), sum(worker_seconds)
  FROM tasks_app_usagerecord
 WHERE status <> 'in_progress'
 GROUP BY owner_id, model, (created_at AT TIME ZONE 'UTC')::date
    ON CONFLICT (owner_id, model, day) DO UPDATE
   SET requests = excluded.requests, input_tokens = excluded.input_tokens,
       output_tokens = excluded.output_tokens, cached_tokens = excluded.cached_tokens,
       worker_seconds = excluded.worker_seconds
"""


def fill_daily_usage(apps, schema_editor):
    """Worker seconds of stored records, then every day's sums (replacing a
    row that is already there: a day is the sum of its ended records)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(WORKER_SECONDS_SQL)
        cursor.execute(DAILY_USAGE_SQL)


class Migration(migrations.Migration):
    dependencies = [
        ("tasks_app", "0007_model_access_budgets_usage"),
    ]

    operations = [
        migrations.RunPython(fill_daily_usage, migrations.RunPython.noop),
    ]
