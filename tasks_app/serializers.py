"""Validation of the ``POST /tasks`` envelope; its ``request`` is the task type's own."""

from __future__ import annotations

from typing import Any, cast

from rest_framework import serializers

from lmsp_core.validation import JSONObjectField, StrictSerializer

from . import task_types


class TaskRequestSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=[])
    request = JSONObjectField()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        choices = cast(serializers.ChoiceField, self.fields["type"])
        choices.choices = task_types.names()  # registered at start-up
