from __future__ import annotations

from typing import TYPE_CHECKING, Any

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from generation.registry import declared_models
from lmsp_core.admin_pages import ChangePageContext

from . import records, transcript
from .models import Response
from .prompting import prompt_of

if TYPE_CHECKING:  # the generic base django-stubs knows; Django's own takes no arguments
    ResponseAdminBase = admin.ModelAdmin[Response]
else:
    ResponseAdminBase = admin.ModelAdmin


@admin.register(Response)
class ResponseAdmin(ChangePageContext, ResponseAdminBase):
    """Read-only: a stored response is exactly what the protocol returned.
    Deleting one erases it with its task and events (``records.erase``), as
    ``DELETE /responses/{id}`` does."""

    list_display = ("id", "owner", "model", "status", "tokens_in", "tokens_out", "created_at")
    list_filter = ("status", "model", "owner", "store", "created_at")
    list_select_related = ("owner",)
    # JSONField's icontains compares against the JSON text, so this finds words
    # anywhere in the messages, tool arguments and tool results.
    search_fields = ("=id", "input", "output")
    search_help_text = "An exact response id, or text the input or output contains."
    date_hierarchy = "created_at"
    readonly_fields = (
        "id",
        "owner",
        "model",
        "status",
        "store",
        "previous_response",
        "input_tokens",
        "output_tokens",
        "error",
        "incomplete_details",
        "params",
        "created_at",
        "completed_at",
        "prompt",
    )
    fieldsets = (
        (None, {"fields": ("id", "owner", "model", "status", "store", "previous_response")}),
        ("Usage", {"fields": ("input_tokens", "output_tokens", "created_at", "completed_at")}),
        ("Outcome", {"fields": ("error", "incomplete_details")}),
        ("Request", {"fields": ("params", "prompt"), "classes": ("collapse",)}),
    )

    # Short headers keep the list one screen wide.
    @admin.display(description="in", ordering="input_tokens")
    def tokens_in(self, response: Response) -> int:
        return response.input_tokens

    @admin.display(description="out", ordering="output_tokens")
    def tokens_out(self, response: Response) -> int:
        return response.output_tokens

    @admin.display(description="prompt")
    def prompt(self, response: Response) -> str:
        """What the model reads for this turn if it runs now: rendered from the
        turns that remain, as the worker renders it (no row keeps it)."""
        spec = declared_models().get(response.model)
        if spec is None:
            return f"(the model {response.model!r} is no longer declared)"
        try:
            return prompt_of(response, spec)
        except OSError:  # its tokenizer's files are not on this machine
            return f"(the files of {response.model!r} are not on this machine)"

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Response | None = None) -> bool:
        return False

    def delete_model(self, request: HttpRequest, obj: Response) -> None:
        records.erase(Response.objects.filter(pk=obj.pk))

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Response]) -> None:
        records.erase(queryset)

    def change_page_context(self, request: HttpRequest, obj: Response | None) -> dict[str, Any]:
        if obj is None:
            return {}
        return {"turns": transcript.conversation(obj), "timeline": transcript.timeline(obj)}
