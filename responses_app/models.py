from django.conf import settings
from django.db import models
from django.utils import timezone

from lmsp_core.status import Status


class Response(models.Model):
    """A response as the protocol returns it, plus the request that made it.

    ``output``, ``error`` and ``incomplete_details`` hold exactly the JSON the
    protocol shows; ``protocol.response_object`` assembles the rest.
    """

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="responses"
    )
    model = models.CharField(max_length=100, db_index=True)
    # Its task's status as the protocol shows it, moved by the task's lifecycle
    # (``tasks_app.transitions.RESPONSE_STATUS``); kept after its task is gone.
    status = models.CharField(max_length=20, choices=Status.choices, default=Status.IN_PROGRESS)
    input = models.JSONField(default=list)
    # Generation settings as validated: temperature, max_output_tokens,
    # response_format, tools, tool_choice.
    params = models.JSONField(default=dict)
    store = models.BooleanField(default=False)
    # A deleted turn leaves the later turns that continued from it: they keep
    # their own input and output, and their context no longer holds its words.
    # No row holds the prompt, which would copy every earlier turn's words: it
    # is rendered from the chain when it is needed (``prompting``).
    previous_response = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="continuations"
    )
    output = models.JSONField(default=list)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    # Input tokens the worker took from its prefix cache (a part of input_tokens).
    cached_tokens = models.PositiveIntegerField(default=0)
    error = models.JSONField(null=True, blank=True)
    incomplete_details = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return self.id
