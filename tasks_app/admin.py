"""Tasks in the admin (cancel, re-queue a failed one), and each owner's LMSP
quotas and usage on the auth user's page: the quotas live with the tasks they
limit, so this app extends the user admin rather than the accounts app."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from django import forms
from django.contrib import admin, messages
from django.contrib.auth import get_user_model
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin
from django.core.exceptions import PermissionDenied
from django.db.models import Model, QuerySet
from django.http import HttpRequest, HttpResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from accounts_app.model_choice import AllowedModelsField
from lmsp_core.admin_pages import ChangePageContext
from lmsp_core.errors import ProblemError

from . import budgets, lifecycle, quotas, selectors
from .models import OwnerQuota, Task

if TYPE_CHECKING:  # the generic bases django-stubs knows; Django's own take no arguments
    from django.contrib.auth.models import User as AuthUser

    TaskAdminBase = admin.ModelAdmin[Task]
    OwnerQuotaFormBase = forms.ModelForm[OwnerQuota]
    OwnerQuotaInlineBase = admin.StackedInline[OwnerQuota, AuthUser]
    UserAdminBase = BaseUserAdmin[AuthUser]
else:
    TaskAdminBase = admin.ModelAdmin
    OwnerQuotaFormBase = forms.ModelForm
    OwnerQuotaInlineBase = admin.StackedInline
    UserAdminBase = BaseUserAdmin


def _apply(
    admin_: admin.ModelAdmin[Task],
    request: HttpRequest,
    tasks: QuerySet[Task],
    change: Callable[[str], object],
    verb: str,
) -> None:
    """Run a lifecycle change per task, reporting each refusal by the task's own reason."""
    done = 0
    for task_id in tasks.values_list("id", flat=True):
        try:
            change(task_id)
        except ProblemError as error:
            admin_.message_user(request, error.detail, messages.WARNING)
        else:
            done += 1
    if done:
        admin_.message_user(request, f"{verb} {done} task(s).", messages.SUCCESS)


@admin.register(Task)
class TaskAdmin(ChangePageContext, TaskAdminBase):
    list_display = (
        "id",
        "owner",
        "model",
        "status",
        "waiting_reason",
        "attempt",
        "created_at",
        "started_at",
        "completed_at",
        "last_event_id",
        "pruned_through",
    )
    list_filter = ("status", "kind", "model", "owner", "created_at")
    list_select_related = ("owner",)
    search_fields = ("=id", "=response__id")
    date_hierarchy = "created_at"
    actions = ("cancel_tasks", "requeue_failed_tasks")
    fields = (
        "id",
        "owner",
        "kind",
        "model",
        "status",
        "response",
        "error",
        "attempt",
        "worker",
        "cancel_requested",
        "waiting_reason",
        "waiting_since",
        "created_at",
        "enqueued_at",
        "started_at",
        "completed_at",
        "lease_expires_at",
        "last_event_id",
        "pruned_through",
    )
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    # A task goes only with its response or its owner, whose deletion pages
    # ask for it; never on its own, which would leave its response behind.
    def has_delete_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        return obj is not None and super().has_delete_permission(request, obj)

    def delete_view(
        self, request: HttpRequest, object_id: str, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        raise PermissionDenied

    def change_page_context(self, request: HttpRequest, obj: Task | None) -> dict[str, Any]:
        return {"show_delete": False}

    # Changes go through the lifecycle only (actions), never through a form;
    # the change permission is what the actions require.
    def has_change_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        return obj is None and super().has_change_permission(request)

    @admin.action(description="Cancel the selected tasks", permissions=["change"])
    def cancel_tasks(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        _apply(self, request, queryset, lifecycle.request_cancel, "Cancelled (or asked to stop)")

    @admin.action(description="Re-queue the selected failed tasks", permissions=["change"])
    def requeue_failed_tasks(self, request: HttpRequest, queryset: QuerySet[Task]) -> None:
        _apply(self, request, queryset, lifecycle.requeue_failed, "Re-queued")


QUOTA_FIELDS = (
    "max_running",
    "max_queued",
    "output_tokens_per_minute",
    "allowed_models",
    "input_tokens_per_day",
    "output_tokens_per_day",
    "input_tokens_per_month",
    "output_tokens_per_month",
)


class OwnerQuotaForm(OwnerQuotaFormBase):
    allowed_models = AllowedModelsField("The models this owner may use. None ticked: every model.")

    class Meta:
        model = OwnerQuota
        fields = QUOTA_FIELDS


class OwnerQuotaInline(OwnerQuotaInlineBase):
    model = OwnerQuota
    form = OwnerQuotaForm
    can_delete = False
    verbose_name = verbose_name_plural = "LMSP quotas (empty: the default from settings)"
    fields = (*QUOTA_FIELDS, "budgets_left")
    readonly_fields = ("budgets_left",)

    @admin.display(description="Budgets now")
    def budgets_left(self, quota: OwnerQuota | None) -> str:
        """Each budget that is set: what its period has used (requests in
        flight with their input and whole output reservation) and what is left."""
        if quota is None or quota.pk is None:
            return "-"
        set_budgets = budgets.current(quota.owner_id, timezone.now())
        if not set_budgets:
            return "No budget."
        return format_html(
            '<span id="lmsp-budgets">{}</span>',
            format_html_join(
                mark_safe("<br>"),
                "{} tokens this UTC {}: {} used or reserved of {}, {} left",
                ((b.tokens, b.period, b.used, b.limit, b.left_after(0, 0)) for b in set_budgets),
            ),
        )


User = get_user_model()
if admin.site.is_registered(User):
    admin.site.unregister(User)


@admin.register(User)
class UserAdmin(UserAdminBase):
    """The auth user's page, with the owner's LMSP quotas and usage."""

    inlines = (*BaseUserAdmin.inlines, OwnerQuotaInline)
    fieldsets = (*(BaseUserAdmin.fieldsets or ()), ("LMSP usage", {"fields": ("lmsp_usage",)}))
    readonly_fields = (*BaseUserAdmin.readonly_fields, "lmsp_usage")

    @admin.display(description="Usage")
    def lmsp_usage(self, user: Model | None) -> str:
        if user is None or user.pk is None:
            return "-"
        usage = selectors.owner_usage(user.pk, timezone.now() - timedelta(hours=24))
        limits = quotas.limits_for(user.pk)

        def of(limit: int) -> str:
            return f" of {limit}" if limit else " (no limit)"

        return format_html(
            '<span id="lmsp-usage">{} queued{}, {} running{}; '
            "{} output tokens in the last minute{}; last 24 h: {} requests, "
            '{} input and {} output tokens</span> (<a id="lmsp-usage-link" href="{}">'
            "usage by day and model</a>)",
            usage.queued,
            of(limits.max_queued),
            usage.running,
            of(limits.max_running),
            usage.output_tokens_last_minute,
            of(limits.output_tokens_per_minute),
            usage.requests,
            usage.input_tokens,
            usage.output_tokens,
            reverse("lmsp-owner-usage", args=[user.pk]),
        )
