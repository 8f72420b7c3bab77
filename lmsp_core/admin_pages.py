"""What the apps' admin pages share: ``ChangePageContext``, the one place an
admin adds to an object's page what it shows beside Django's form (a
response's conversation, a task's page without a delete link).

It hooks ``render_change_form``, where Django hands over the object it has
read already, rather than ``change_view``, which would read it again.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse


class ChangePageContext:
    """A mixin for a ``ModelAdmin`` (before it among the bases): the context
    of an object's page gets ``change_page_context``."""

    def change_page_context(self, request: HttpRequest, obj: Any) -> dict[str, Any]:
        """What the page of ``obj`` (None: a new object's) shows besides the form."""
        return {}

    def render_change_form(
        self,
        request: HttpRequest,
        context: dict[str, Any],
        add: bool = False,
        change: bool = False,
        form_url: str = "",
        obj: Any = None,
    ) -> HttpResponse:
        context.update(self.change_page_context(request, obj))
        model_admin: Any = super()  # the ModelAdmin that follows in the bases
        page: HttpResponse = model_admin.render_change_form(
            request, context, add, change, form_url, obj
        )
        return page
