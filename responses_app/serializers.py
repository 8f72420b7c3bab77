"""Validation of LMSP requests (section 6.1 and contract section 5).

No coercion: a field of the wrong JSON type is refused, never converted.
Unknown fields and item types are refused by name. Errors carry the
contract's code (``ErrorDetail.code``) and are turned into a problem
document naming the field (``validation_problem``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, cast

from django.conf import settings
from rest_framework import serializers

from generation.schema_bounds import schema_bounds_problem
from lmsp_core.ids import is_valid_id
from lmsp_core.validation import (
    JSONObjectField,
    StrictBooleanField,
    StrictCharField,
    StrictFloatField,
    StrictIntegerField,
    StrictListField,
    StrictSerializer,
    json_type,
    validation_problem,
)

RESERVED_PART_TYPES = ("input_image", "input_audio", "input_file")
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


# --- input items ----------------------------------------------------------------


class TextPartSerializer(StrictSerializer):
    type = StrictCharField()
    text = StrictCharField(allow_blank=True, trim_whitespace=False)
    annotations = StrictListField(required=False)

    def run_validation(self, data: object = serializers.empty) -> dict[str, Any]:
        """The common part, ``{"type": ..., "text": "..."}`` (its type already
        checked by ``TypedObjectField``), is what the fields would return as
        it is: taken in a microsecond instead of DRF's 40 us, for the 30,000
        parts a megabyte can hold. Anything else goes through the fields."""
        if type(data) is dict and data.keys() == {"type", "text"} and type(data["text"]) is str:
            return {"type": data["type"], "text": data["text"]}
        validated: dict[str, Any] = super().run_validation(data)
        return validated


def run_nested(serializer_class: type[serializers.Serializer[Any]], data: object) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    if not serializer.is_valid():
        raise serializers.ValidationError(serializer.errors)
    return dict(serializer.validated_data)


class TypedObjectField(serializers.Field[dict[str, Any], object, Any, Any]):
    """An object whose ``type`` member chooses the serializer that checks it.

    One serializer per type checks every member of a list: a serializer
    made per member copies its fields each time, which cost about 250 us a
    member (seconds for the 30,000 content parts a megabyte can hold).
    """

    def __init__(
        self,
        what: str,
        by_type: Mapping[str, type[serializers.Serializer[Any]]],
        reserved: tuple[str, ...] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.what, self.reserved = what, reserved
        self.by_type = {kind: serializer_class() for kind, serializer_class in by_type.items()}

    def to_internal_value(self, data: object) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                f"Expected {self.what} object, got {json_type(data)}."
            )
        kind = data.get("type")
        if not isinstance(kind, str):
            raise serializers.ValidationError(
                {"type": [f"Expected a string naming {self.what} type, got {json_type(kind)}."]}
            )
        if kind in self.reserved:
            reserved = f"Content type {kind!r} is reserved in LMSP 1.0; only text is supported."
            error = serializers.ErrorDetail(reserved, code="unsupported_content_type")
            raise serializers.ValidationError({"type": [error]})
        if kind not in self.by_type:
            shown = kind if len(kind) <= 64 else kind[:64] + "..."
            raise serializers.ValidationError({"type": [f"Unknown {self.what} type {shown!r}."]})
        return dict(self.by_type[kind].run_validation(data))


PART_SERIALIZERS = {"input_text": TextPartSerializer, "output_text": TextPartSerializer}


class MessageItemSerializer(StrictSerializer):
    type = StrictCharField()
    id = StrictCharField(required=False)
    status = StrictCharField(required=False)
    role = serializers.ChoiceField(choices=["system", "user", "assistant"])
    content = StrictListField(
        child=TypedObjectField("a content part", PART_SERIALIZERS, RESERVED_PART_TYPES),
        limit="LMSP_MAX_CONTENT_PARTS",
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        for index, part in enumerate(attrs["content"]):
            allowed = "output_text" if attrs["role"] == "assistant" else "input_text"
            if part["type"] not in (allowed, "input_text"):
                raise serializers.ValidationError(
                    {
                        "content": {  # keyed by the part's index, as DRF's own errors
                            cast(str, index): {
                                "type": [
                                    f"A {attrs['role']} message cannot hold {part['type']!r} parts."
                                ]
                            }
                        }
                    }
                )
        return attrs


class FunctionCallItemSerializer(StrictSerializer):
    type = StrictCharField()
    id = StrictCharField(required=False)
    status = StrictCharField(required=False)
    call_id = StrictCharField()
    name = StrictCharField()
    arguments = StrictCharField(allow_blank=True, trim_whitespace=False)


class FunctionCallOutputItemSerializer(StrictSerializer):
    type = StrictCharField()
    id = StrictCharField(required=False)
    status = StrictCharField(required=False)
    call_id = StrictCharField()
    output = StrictCharField(allow_blank=True, trim_whitespace=False)


class SummaryPartSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["summary_text"])
    text = StrictCharField(allow_blank=True, trim_whitespace=False)


class ReasoningItemSerializer(StrictSerializer):
    type = StrictCharField()
    id = StrictCharField(required=False)
    status = StrictCharField(required=False)
    summary = StrictListField(child=SummaryPartSerializer(), limit="LMSP_MAX_CONTENT_PARTS")


ITEM_SERIALIZERS = {
    "message": MessageItemSerializer,
    "function_call": FunctionCallItemSerializer,
    "function_call_output": FunctionCallOutputItemSerializer,
    "reasoning": ReasoningItemSerializer,
}


# --- tools and formats -----------------------------------------------------------


class SchemaField(JSONObjectField):
    """A JSON Schema object within the bounds that keep compiling it cheap
    (``generation.schema_bounds``, limits from the settings)."""

    def to_internal_value(self, data: object) -> dict[str, Any]:
        schema = super().to_internal_value(data)
        problem = schema_bounds_problem(
            schema,
            "",
            max_bytes=settings.LMSP_MAX_SCHEMA_BYTES,
            max_depth=settings.LMSP_MAX_SCHEMA_DEPTH,
            max_repeat=settings.LMSP_MAX_PATTERN_REPEAT,
        )
        if problem is not None:
            where, reason = problem
            inside = f" (at {where.lstrip('.')})" if where else ""
            raise serializers.ValidationError(f"{reason}{inside}")
        return schema


class FunctionToolSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["function"])
    name = StrictCharField()
    description = StrictCharField(required=False, allow_blank=True)
    parameters = SchemaField(required=False)
    strict = StrictBooleanField(required=False)

    def validate_name(self, value: str) -> str:
        if not TOOL_NAME.fullmatch(value):
            raise serializers.ValidationError("Tool names are 1 to 64 letters, digits, '_' or '-'.")
        return value


class ToolChoiceField(serializers.Field[str | dict[str, Any], object, Any, Any]):
    def to_internal_value(self, data: object) -> str | dict[str, Any]:
        if isinstance(data, str):
            if data not in ("auto", "none", "required"):
                raise serializers.ValidationError(
                    "Expected 'auto', 'none', 'required'"
                    ' or {"type": "function", "name": ...}.'
                )
            return data
        return run_nested(NamedToolChoiceSerializer, data)


class NamedToolChoiceSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["function"])
    name = StrictCharField()


class JsonSchemaFormatSerializer(StrictSerializer):
    name = StrictCharField()
    schema = SchemaField()
    description = StrictCharField(required=False, allow_blank=True)
    strict = StrictBooleanField(required=False)


class ResponseFormatSerializer(StrictSerializer):
    type = serializers.ChoiceField(choices=["text", "json_schema"])
    json_schema = JsonSchemaFormatSerializer(required=False)

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["type"] == "json_schema" and "json_schema" not in attrs:
            raise serializers.ValidationError({"json_schema": ["This field is required."]})
        if attrs["type"] == "text" and "json_schema" in attrs:
            raise serializers.ValidationError(
                {"json_schema": ["Only allowed with type json_schema."]}
            )
        return attrs


# --- the request -----------------------------------------------------------------


class ResponseRequestSerializer(StrictSerializer):
    model = StrictCharField()
    input = StrictListField(
        child=TypedObjectField("an input item", ITEM_SERIALIZERS),
        allow_empty=False,
        limit="LMSP_MAX_INPUT_ITEMS",
    )
    stream = StrictBooleanField(required=False, default=False)
    max_output_tokens = StrictIntegerField(required=False, min_value=1)
    temperature = StrictFloatField(required=False, min_value=0.0, max_value=2.0, default=1.0)
    response_format = ResponseFormatSerializer(required=False)
    tools = StrictListField(child=FunctionToolSerializer(), required=False, limit="LMSP_MAX_TOOLS")
    tool_choice = ToolChoiceField(required=False)
    store = StrictBooleanField(required=False, default=False)
    previous_response_id = StrictCharField(required=False)
    extensions = JSONObjectField(required=False)

    def validate_previous_response_id(self, value: str) -> str:
        if not is_valid_id(value, "resp"):
            raise serializers.ValidationError("Expected a response id (resp_ and a ULID).")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        tools = attrs.get("tools") or []
        names = [tool["name"] for tool in tools]
        if len(names) != len(set(names)):
            raise serializers.ValidationError({"tools": ["Tool names must be unique."]})
        choice = attrs.get("tool_choice")
        if isinstance(choice, dict) and choice["name"] not in names:
            raise serializers.ValidationError(
                {"tool_choice": {"name": [f"No tool named {choice['name']!r} in tools."]}}
            )
        if choice == "required" and not tools:
            raise serializers.ValidationError(
                {"tool_choice": ["'required' needs at least one tool."]}
            )
        return attrs


def validate_response_request(data: object, prefix: str = "") -> dict[str, Any]:
    serializer = ResponseRequestSerializer(data=data)
    if not serializer.is_valid():
        raise validation_problem(serializer.errors, prefix)
    return dict(serializer.validated_data)
