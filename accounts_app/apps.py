from django.apps import AppConfig


class AccountsAppConfig(AppConfig):
    name = "accounts_app"
    verbose_name = "API access"

    def ready(self) -> None:
        """Whatever takes a token's access away ends the streams it opened."""
        from django.contrib.auth import get_user_model
        from django.db.models.signals import post_delete, post_save

        from . import revocation
        from .models import ApiToken

        user = get_user_model()
        post_save.connect(revocation.token_saved, sender=ApiToken, dispatch_uid="access.token")
        post_delete.connect(revocation.token_deleted, sender=ApiToken, dispatch_uid="access.token")
        post_save.connect(revocation.owner_saved, sender=user, dispatch_uid="access.owner")
        post_delete.connect(revocation.owner_deleted, sender=user, dispatch_uid="access.owner")
