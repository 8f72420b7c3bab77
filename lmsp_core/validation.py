"""Strict request validation with DRF, and the problem document for its first error.

No coercion: a field of the wrong JSON type is refused, never converted, and
an object refuses members it does not declare. ``validation_problem`` names
the first failing field (``input[0].content[0].type``) in a problem document.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
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
    """A JSON array; with ``limit`` (the name of a setting), of at most that
    many members, counted before any member is validated."""

    def __init__(self, *args: Any, limit: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit = limit

    def to_internal_value(self, data: object) -> list[Any]:
        if not isinstance(data, list):
            self.fail("not_a_list", input_type=type(data).__name__)
        if self.limit is not None:
            most = getattr(settings, self.limit)
            if len(data) > most:
                raise serializers.ValidationError(
                    f"At most {most} members are allowed ({self.limit}); got {len(data)}."
                )
        return super().to_internal_value(data)

    def run_child_validation(self, data: list[Any]) -> list[Any]:
        """The members validated, up to the first that fails: only the first
        error is reported (``validation_problem``), and DRF's collecting one
        per member cost seconds for a list of thousands that all fail."""
        validated = []
        for index, member in enumerate(data):
            try:
                validated.append(self.child.run_validation(member))
            except serializers.ValidationError as exc:
                # DRF names a member of a list by its index in what it reports
                detail: Any = {index: exc.detail}
                raise serializers.ValidationError(detail) from exc
        return validated


class JSONObjectField(serializers.JSONField):
    def to_internal_value(self, data: object) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError("Expected a JSON object.")
        return data


class StrictSerializer(serializers.Serializer[Any]):
    """Refuses members it does not declare, and anything but a JSON object."""

    def to_internal_value(self, data: object) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise serializers.ValidationError(
                {"non_field_errors": [f"Expected a JSON object, got {json_type(data)}."]}
            )
        unknown = [key for key in data if key not in self.fields]
        if unknown:
            raise serializers.ValidationError({unknown[0]: [f"Unknown field {unknown[0]!r}."]})
        validated: dict[str, Any] = super().to_internal_value(data)
        return validated


def json_type(value: object) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "number", float: "number", str: "string", list: "array"}.get(
        type(value), "object"
    )


# --- query parameters and headers ------------------------------------------------

_DECIMAL = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit accepts "²"


def integer_param(raw: str, name: str, low: int, high: int | None = None) -> int:
    """A query parameter or header holding a decimal integer in bounds, else 400
    naming it. Only ASCII digits, at most 18 of them."""
    if _DECIMAL.fullmatch(raw) is None or int(raw) < low or (high is not None and int(raw) > high):
        bounds = f"from {low} to {high}" if high is not None else f"at least {low}"
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise ProblemError(
            "invalid_request", f"{name} must be an integer {bounds}, not {shown!r}.", param=name
        )
    return int(raw)


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
            name = str(key) if len(str(key)) <= 64 else str(key)[:64] + "..."
            child = f"{path}.{name}" if path else name
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
