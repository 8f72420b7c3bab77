"""The playground app's configuration (no models: it is a page over the API)."""

from django.apps import AppConfig


class PlaygroundConfig(AppConfig):
    name = "playground_app"
    verbose_name = "Playground"
