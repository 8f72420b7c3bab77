"""Checks shared by the translations of OpenAI requests.

OpenAI's APIs have many more fields than LMSP; a field this service cannot
honour is refused with a 400 naming it, never silently dropped. A field whose
value changes nothing here (``n: 1``, ``top_p: 1``) is accepted with that
value only; ``null`` stands for "not sent", as OpenAI treats it.
"""

from __future__ import annotations

from typing import Any

from lmsp_core.errors import ProblemError
from lmsp_core.validation import json_type


def invalid(param: str, detail: str, code: str = "invalid_request") -> ProblemError:
    return ProblemError(code, f"{param}: {detail}", param=param)


def require_object(value: object, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise invalid(param, f"Expected an object, got {json_type(value)}.")
    return value


def require_list(value: object, param: str) -> list[Any]:
    if not isinstance(value, list):
        raise invalid(param, f"Expected an array, got {json_type(value)}.")
    return value


def sent(body: dict[str, Any]) -> dict[str, Any]:
    """The members of an OpenAI object that were sent (``null`` is not sending)."""
    return {name: value for name, value in body.items() if value is not None}


def check_fields(
    body: dict[str, Any], supported: set[str], neutral: dict[str, tuple[Any, ...]], prefix: str = ""
) -> None:
    """Refuse members this service does not support, and members of
    ``neutral`` with any value other than the ones that change nothing."""
    for name, value in body.items():
        param = f"{prefix}{name}"
        if name in neutral:
            if not any(_same(value, allowed) for allowed in neutral[name]):
                allowed = " or ".join(_json(v) for v in neutral[name])
                raise invalid(param, f"Only {allowed} is supported by this service.")
        elif name not in supported:
            raise invalid(param, "This parameter is not supported by this service.")


def _same(value: object, allowed: object) -> bool:
    return value == allowed and isinstance(value, bool) == isinstance(allowed, bool)


def _json(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if not isinstance(value, list) else str(value).replace("'", '"')


def unsupported_content(param: str, kind: str) -> ProblemError:
    return invalid(
        param,
        f"Content of type {kind!r} is not supported; this service takes text only.",
        code="unsupported_content_type",
    )
