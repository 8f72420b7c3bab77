from typing import Any

from django.core.management.base import BaseCommand

from accounts_app.models import SCOPES, ApiToken
from accounts_app.services import create_token

DEV_USER = "dev"


class Command(BaseCommand):
    help = "Create a token with every scope for the 'dev' user, once, and print it."

    def handle(self, *args: object, **options: Any) -> None:
        if ApiToken.objects.filter(owner__username=DEV_USER, revoked_at__isnull=True).exists():
            self.stdout.write(
                f"The {DEV_USER!r} user already has a token (shown when it was created). "
                f"Make another: python manage.py lmsp_token create --user {DEV_USER} "
                f"--scopes {','.join(SCOPES)}"
            )
            return
        issued = create_token(username=DEV_USER, scopes=list(SCOPES), name="dev")
        self.stdout.write(f"Dev token for {DEV_USER!r} (all scopes), shown only this once:")
        self.stdout.write(issued.secret)
