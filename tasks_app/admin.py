from collections.abc import Callable

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from lmsp_core.errors import ProblemError

from . import lifecycle
from .models import Task


def _apply(
    admin_: admin.ModelAdmin,
    request: HttpRequest,
    tasks: QuerySet,
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
class TaskAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "owner",
        "model",
        "status",
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

    def has_delete_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        return False

    # Changes go through the lifecycle only (actions), never through a form;
    # the change permission is what the actions require.
    def has_change_permission(self, request: HttpRequest, obj: Task | None = None) -> bool:
        return obj is None and super().has_change_permission(request)

    @admin.action(description="Cancel the selected tasks", permissions=["change"])
    def cancel_tasks(self, request: HttpRequest, queryset: QuerySet) -> None:
        _apply(self, request, queryset, lifecycle.request_cancel, "Cancelled (or asked to stop)")

    @admin.action(description="Re-queue the selected failed tasks", permissions=["change"])
    def requeue_failed_tasks(self, request: HttpRequest, queryset: QuerySet) -> None:
        _apply(self, request, queryset, lifecycle.requeue_failed, "Re-queued")
