"""Strict request validation with DRF, and the problem document for its first error.

No coercion: a field of the wrong JSON type is refused, never converted, and
an object refuses members it does not declare. ``validation_problem`` names
the first failing field (``input[0].content[0].type``) in a problem document.
"""

from __future__ import annotations

from rest_framework import serializers

from .errors import ProblemError

# --- strict scalar fields ---------------------------------------------------------


class StrictCharField(serializers.CharField):
    def to_internal_value(self, data: object) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictBooleanField(serializers.BooleanField):
    def to_internal_value(self, data: object) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid", input=data)
        return data


class StrictIntegerField(serializers.IntegerField):
    def to_internal_value(self, data: object) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictFloatField(serializers.FloatField):
    def to_internal_value(self, data: object) -> float:
        if isinstance(data, bool) or not isinstance(data, int | float):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictListField(serializers.ListField):
    def to_internal_value(self, data: object) -> list:
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        return super().to_internal_value(data)


class JSONObjectField(serializers.JSONField):
    def to_internal_value(self, data: object) -> dict:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Expected a JSON object.")
        return data


class StrictSerializer(serializers.Serializer):
    """Refuses members it does not declare, and anything but a JSON object."""

    def to_internal_value(self, data: object) -> dict:
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": [f"Expected a JSON object, got {json_type(data)}."]}
            )
        unknown = [key for key in data if key not in self.fields]
        if unknown:
            raise serializers.ValidationError({unknown[0]: [f"Unknown field {unknown[0]!r}."]})
        return super().to_internal_value(data)


def json_type(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(
        type(value), "object"
    )


# --- errors ---------------------------------------------------------------------


def _first_error(detail: object, path: str = "") -> tuple[str, object]:
    """The path (``input[0].content[0].type``) and message of the first error."""
    if isinstance(detail, dict):
        key, value = next(iter(detail.items()))
        if isinstance(key, int):
            child = f"{path}[{key}]"
        elif key == "non_field_errors":
            child = path
        else:
            child = f"{path}.{key}" if path else str(key)
        return _first_error(value, child)
    if isinstance(detail, list):
        for index, value in enumerate(detail):
            if isinstance(value, str):
                return path, value
            if value:  # a many=True list holds empty entries for valid members
                return _first_error(value, f"{path}[{index}]")
    return path, detail


def validation_problem(errors: object, prefix: str = "") -> ProblemError:
    """The problem document for the first error of a serializer."""
    path, detail = _first_error(errors)
    if prefix:
        path = f"{prefix}.{path}" if path else prefix
    code = getattr(detail, "code", None)
    problem_code = (
        "unsupported_content_type" if code == "unsupported_content_type" else "invalid_request"
    )
    return ProblemError(problem_code, f"{path or 'body'}: {detail}", param=path or None)
