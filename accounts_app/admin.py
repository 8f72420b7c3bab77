from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.db.models import Q, QuerySet
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.utils import timezone

from . import services
from .model_choice import AllowedModelsField
from .models import SCOPES, ApiToken

if TYPE_CHECKING:  # the generic bases django-stubs knows; Django's own take no arguments
    TokenForm = forms.ModelForm[ApiToken]
    TokenAdminBase = admin.ModelAdmin[ApiToken]
else:
    TokenForm = forms.ModelForm
    TokenAdminBase = admin.ModelAdmin

SECONDS_PER_DAY = 86_400


# The request attribute that carries a new token's secret from save_model to
# the answer page, the only place it is shown.
ISSUED_SECRET = "lmsp_issued_secret"


TOKEN_MODELS_HELP = "The models this token may use, among its owner's. None ticked: all of them."


class ApiTokenCreationForm(TokenForm):
    scopes = forms.MultipleChoiceField(
        choices=[(scope, scope) for scope in SCOPES], widget=forms.CheckboxSelectMultiple
    )
    expires_in_days = forms.IntegerField(
        min_value=1, required=False, label="Expires in (days)", help_text="Empty: never expires."
    )
    allowed_models = AllowedModelsField(TOKEN_MODELS_HELP)

    class Meta:
        model = ApiToken
        fields = ("owner", "name")


class ApiTokenChangeForm(TokenForm):
    allowed_models = AllowedModelsField(TOKEN_MODELS_HELP)

    class Meta:
        model = ApiToken
        fields = ("name", "expires_at", "allowed_models")


class TokenStateFilter(admin.SimpleListFilter):
    title = "state"
    parameter_name = "state"

    def lookups(
        self, request: HttpRequest, model_admin: admin.ModelAdmin[Any]
    ) -> list[tuple[str, str]]:
        return [("active", "Active"), ("expired", "Expired"), ("revoked", "Revoked")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> QuerySet[ApiToken]:
        now = timezone.now()
        unexpired = Q(expires_at__isnull=True) | Q(expires_at__gt=now)
        if self.value() == "active":
            return queryset.filter(unexpired, revoked_at__isnull=True)
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=now, revoked_at__isnull=True)
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        return queryset


@admin.register(ApiToken)
class ApiTokenAdmin(TokenAdminBase):
    """Tokens are issued by ``services.issue_token``: the secret is shown on the
    page that answers the creation, once, and only its hash is ever stored."""

    list_display = (
        "prefix",
        "name",
        "owner",
        "scope_list",
        "state",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    )
    list_filter = (TokenStateFilter, "owner")
    list_select_related = ("owner",)
    search_fields = ("prefix", "name", "owner__username")
    actions = ("revoke",)
    form = ApiTokenChangeForm
    add_form = ApiTokenCreationForm
    add_fieldsets = (
        (None, {"fields": ("owner", "name", "scopes", "allowed_models", "expires_in_days")}),
    )
    fields = (
        "prefix",
        "owner",
        "name",
        "scope_list",
        "allowed_models",
        "state",
        "created_at",
        "expires_at",
        "last_used_at",
        "revoked_at",
    )
    readonly_fields = (
        "prefix",
        "owner",
        "scope_list",
        "state",
        "created_at",
        "last_used_at",
        "revoked_at",
    )

    @admin.display(description="scopes")
    def scope_list(self, token: ApiToken) -> str:
        return ", ".join(token.scopes)

    @admin.display(description="state")
    def state(self, token: ApiToken) -> str:
        if token.revoked_at is not None:
            return "revoked"
        return "active" if token.is_active() else "expired"

    def get_fieldsets(self, request: HttpRequest, obj: ApiToken | None = None) -> Any:
        return self.add_fieldsets if obj is None else super().get_fieldsets(request, obj)

    def get_readonly_fields(self, request: HttpRequest, obj: ApiToken | None = None) -> Any:
        return () if obj is None else self.readonly_fields

    def get_form(
        self, request: HttpRequest, obj: ApiToken | None = None, change: bool = False, **kwargs: Any
    ) -> type[forms.ModelForm[ApiToken]]:
        if obj is None:
            kwargs["form"] = self.add_form
            kwargs["fields"] = None  # the form's own fields, not the change page's
        return super().get_form(request, obj, change, **kwargs)

    def save_model(
        self, request: HttpRequest, obj: ApiToken, form: forms.ModelForm[ApiToken], change: bool
    ) -> None:
        if change:
            super().save_model(request, obj, form, change)
            return
        days = form.cleaned_data["expires_in_days"]
        issued = services.issue_token(
            owner=obj.owner,
            scopes=form.cleaned_data["scopes"],
            expires_in=days * SECONDS_PER_DAY if days else None,
            name=obj.name,
            allowed_models=form.cleaned_data["allowed_models"],
        )
        # The admin goes on with ``obj`` (history entry, answer page): make it the issued token.
        obj.__dict__.update(issued.token.__dict__)
        setattr(request, ISSUED_SECRET, issued.secret)  # read by response_add

    def response_add(
        self, request: HttpRequest, obj: ApiToken, post_url_continue: str | None = None
    ) -> HttpResponse:
        """The secret goes into this page only: no redirect, no message cookie,
        no session, so it cannot be shown a second time."""
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "API token created",
            "token": obj,
            "secret": getattr(request, ISSUED_SECRET),
        }
        answer = TemplateResponse(request, "admin/accounts_app/apitoken/issued.html", context)
        answer["Cache-Control"] = "no-store"
        return answer

    @admin.action(description="Revoke the selected tokens", permissions=["change"])
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        revoked = sum(
            services.revoke_token(prefix) for prefix in queryset.values_list("prefix", flat=True)
        )
        self.message_user(request, f"Revoked {revoked} token(s).", messages.SUCCESS)
