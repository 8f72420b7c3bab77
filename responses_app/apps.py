from django.apps import AppConfig


class ResponsesAppConfig(AppConfig):
    name = "responses_app"
    verbose_name = "Responses"
