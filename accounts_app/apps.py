from django.apps import AppConfig


class AccountsAppConfig(AppConfig):
    name = "accounts_app"
    verbose_name = "API access"
