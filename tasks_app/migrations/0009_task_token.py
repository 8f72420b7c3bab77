"""A task remembers the token that submitted it, so that it runs only while
that token may still be used (``tasks_app.entitlement``)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("accounts_app", "0002_token_allowed_models"),
        ("tasks_app", "0008_fill_daily_usage"),
    ]

    operations = [
        migrations.AddField(
            model_name="task",
            name="token",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                null=True,
                on_delete=django.db.models.deletion.DO_NOTHING,
                related_name="+",
                to="accounts_app.apitoken",
            ),
        ),
    ]
