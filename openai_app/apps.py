"""Django app registration of the OpenAI-compatible adapter."""

from django.apps import AppConfig


class OpenAIAppConfig(AppConfig):
    name = "openai_app"
    verbose_name = "OpenAI-compatible API"
