"""A JSON parser that refuses what Python's json module would let through.

Request bodies are parsed here and nowhere else, so this is where every value
that could not be stored or computed with is refused, with the path of the
member at fault (``param``): invalid UTF-8, duplicate keys, NaN and Infinity,
numbers that overflow to infinity (``1e999``) or are thousands of digits
long, integers outside 64 bits, U+0000 and lone surrogates (PostgreSQL
stores neither), and nesting deeper than ``LMSP_MAX_JSON_DEPTH`` (checked on
the raw bytes before parsing, so that a 3,000-deep body never reaches the
recursive parser).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import IO, Any

from django.conf import settings
from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from .errors import ProblemError

# Numbers: integers must fit in 64 bits, and no literal may be longer than
# this (a 5,000-digit literal costs quadratic time to convert, and a float
# that long carries no more precision than a short one).
MAX_NUMBER_CHARS = 100
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
# Characters PostgreSQL cannot store in text or jsonb, or UTF-8 cannot encode.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
_LONGEST_KEY_IN_PARAM = 64


class _Refused:
    """Left in the parsed value by a parse hook where a literal is refused, so
    that the walk that follows can name the member holding it."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


# In a valid JSON text, U+0000 and surrogates can only come from \u escapes
# (raw, one is a control character the parser refuses and the other is not
# UTF-8): a body without such an escape and without a refused literal needs
# no walk. A false alarm (an escaped backslash before "u0000", a surrogate
# pair) only costs the walk, which is exact.
_SUSPECT_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])")


def _parse_int(literal: str) -> int | _Refused:
    if len(literal) > MAX_NUMBER_CHARS:
        return _Refused(f"a number {len(literal)} characters long (at most {MAX_NUMBER_CHARS})")
    value = int(literal)
    if not INT_MIN <= value <= INT_MAX:
        return _Refused("an integer outside the 64-bit range")
    return value


def _parse_float(literal: str) -> float | _Refused:
    if len(literal) > MAX_NUMBER_CHARS:
        return _Refused(f"a number {len(literal)} characters long (at most {MAX_NUMBER_CHARS})")
    value = float(literal)
    if value in (float("inf"), float("-inf")):
        return _Refused(f"a number too large to represent ({literal})")
    return value


def _parse_constant(name: str) -> _Refused:
    return _Refused(f"{name}, which is not valid JSON")


# --- nesting depth, on the raw bytes ----------------------------------------------

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_EMPTY_PAIR = re.compile(rb"\[\]|\{\}")


def too_deep(raw: bytes, limit: int) -> bool:
    """Whether arrays and objects nest more than ``limit`` deep.

    Strings removed, only brackets are left; each round removes the innermost
    pairs, so a body is at most ``limit`` deep if ``limit`` rounds empty it.
    Every step is a regular expression (C speed), whatever the body.
    """
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    for _ in range(limit):
        if not brackets:
            return False
        brackets, removed = _EMPTY_PAIR.subn(b"", brackets)
        if not removed:
            return False  # unbalanced: the parser will say where
    return bool(brackets)


_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{},]')


def _key_in_param(key: str) -> str:
    if len(key) > _LONGEST_KEY_IN_PARAM:
        return key[:_LONGEST_KEY_IN_PARAM] + "..."
    return key


def deep_path(text: str, limit: int) -> str:
    """The path of the first member nested deeper than ``limit`` (slow: run
    only on a body already known to be too deep; stops at that member)."""
    stack: list[list[Any]] = []  # ["[", index] or ["{", key]
    for match in _TOKEN.finditer(text):
        token = match.group(0)
        if token in "[{":
            if len(stack) >= limit:
                return _path(stack) or "body"
            stack.append([token, 0 if token == "[" else None])
        elif token in "]}":
            if stack:
                stack.pop()
        elif token == ",":
            if stack and stack[-1][0] == "[":
                stack[-1][1] += 1
        elif match.group(1) and stack and stack[-1][0] == "{":
            try:
                stack[-1][1] = json.loads(token[: token.rindex('"') + 1])
            except ValueError:
                stack[-1][1] = "?"
    return _path(stack) or "body"


def _path(stack: list[list[Any]]) -> str:
    path = ""
    for kind, where in stack:
        if kind == "[":
            path += f"[{where}]"
        elif where is not None:
            key = _key_in_param(str(where))
            path = f"{path}.{key}" if path else key
    return path


# --- the walk --------------------------------------------------------------------


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    key = _key_in_param(key)
    return f"{path}.{key}" if path else key


def _check_values(value: object) -> None:
    """Refuse the first literal a hook refused and every unstorable string."""
    pending: list[tuple[object, str]] = [(value, "")]
    while pending:
        current, path = pending.pop()
        if isinstance(current, str):
            if _UNSTORABLE.search(current):
                raise _unstorable(path)
        elif isinstance(current, dict):
            for key, member in current.items():
                if _UNSTORABLE.search(key):
                    raise ProblemError(
                        "invalid_request",
                        f"{path or 'body'}: a member name contains U+0000 or a lone surrogate.",
                        param=path or "body",
                    )
                pending.append((member, _child(path, key)))
        elif isinstance(current, list):
            pending.extend((member, _child(path, index)) for index, member in enumerate(current))
        elif isinstance(current, _Refused):
            raise ProblemError(
                "invalid_request", f"{path or 'body'}: {current.reason}.", param=path or "body"
            )


def _unstorable(path: str) -> ProblemError:
    return ProblemError(
        "invalid_request",
        f"{path or 'body'}: the text contains U+0000 or a lone surrogate, which cannot be stored.",
        param=path or "body",
    )


def loads_strict(raw: bytes) -> object:
    """Parse a request body: UTF-8 JSON, no NaN/Infinity, no duplicate keys,
    nothing PostgreSQL cannot store, at most ``LMSP_MAX_JSON_DEPTH`` deep."""

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise ValueError(f"duplicate key {key[:_LONGEST_KEY_IN_PARAM]!r}")
            result[key] = value
        return result

    limit = settings.LMSP_MAX_JSON_DEPTH
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProblemError(
            "invalid_request", f"Malformed JSON body: not UTF-8 ({exc.reason}).", param="body"
        ) from exc
    if too_deep(raw, limit):
        path = deep_path(text, limit)
        raise ProblemError(
            "invalid_request",
            f"{path}: arrays and objects nest more than {limit} deep.",
            param=path,
        )
    refused: list[_Refused] = []

    def noting(hook: Callable[[str], object]) -> Callable[[str], object]:
        def parse(literal: str) -> object:
            value = hook(literal)
            if isinstance(value, _Refused):
                refused.append(value)
            return value

        return parse

    try:
        value = json.loads(
            text,
            parse_int=noting(_parse_int),
            parse_float=noting(_parse_float),
            parse_constant=noting(_parse_constant),
            object_pairs_hook=no_duplicates,
        )
    except RecursionError as exc:  # unbalanced brackets that the depth check let by
        raise ProblemError(
            "invalid_request", f"Malformed JSON body: nested more than {limit} deep.", param="body"
        ) from exc
    except ValueError as exc:
        raise ProblemError("invalid_request", f"Malformed JSON body: {exc}", param="body") from exc
    if refused or _SUSPECT_ESCAPE.search(raw):
        _check_values(value)
    return value


class StrictJSONParser(JSONParser):
    def parse(
        self,
        stream: IO[bytes] | None,
        media_type: str | None = None,
        parser_context: Mapping[str, Any] | None = None,
    ) -> Any:
        raw = stream.read() if stream is not None else b""
        if not raw:
            raise ParseError("the body is empty")
        return loads_strict(raw)
