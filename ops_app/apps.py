"""The ops app's configuration (no models: its numbers live in Redis and in
the other apps' tables)."""

from django.apps import AppConfig


class OpsConfig(AppConfig):
    name = "ops_app"
    verbose_name = "Operations"
