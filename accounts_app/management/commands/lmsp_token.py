from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from accounts_app.services import PREFIX_LENGTH, create_token, revoke_token


class Command(BaseCommand):
    help = "Create or revoke LMSP API tokens."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        create = sub.add_parser("create", help="Create a token; prints it on the last line.")
        create.add_argument("--user", required=True)
        create.add_argument("--scopes", required=True, help="comma separated")
        create.add_argument("--expires-in", type=int, default=None, help="seconds")
        create.add_argument("--name", default="")
        revoke = sub.add_parser(
            "revoke", help=f"Revoke the token with this whole {PREFIX_LENGTH}-character prefix."
        )
        revoke.add_argument("prefix")

    def handle(self, *args: object, **options: Any) -> None:
        if options["action"] == "create":
            try:
                issued = create_token(
                    username=options["user"],
                    scopes=options["scopes"],
                    expires_in=options["expires_in"],
                    name=options["name"],
                )
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(
                f"Created token {issued.token.prefix} for {options['user']} "
                f"with scopes {','.join(issued.token.scopes)}. It is shown only once:"
            )
            self.stdout.write(issued.secret)
        else:
            count = revoke_token(options["prefix"])
            if count == 0:
                raise CommandError(
                    f"No active token with the prefix {options['prefix']!r}; give the whole "
                    f"{PREFIX_LENGTH}-character prefix (or the token itself)."
                )
            self.stdout.write(f"Revoked {count} token.")
