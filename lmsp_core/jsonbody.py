"""A JSON parser that refuses what Python's json module would let through."""

import json
import math
from typing import IO

from rest_framework.exceptions import ParseError
from rest_framework.parsers import JSONParser

from .errors import ProblemError


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def loads_strict(raw: bytes) -> object:
    """Parse a request body: UTF-8 JSON, no NaN/Infinity, no duplicate keys."""

    def no_duplicates(pairs: list[tuple[str, object]]) -> dict:
        keys = [key for key, _ in pairs]
        if len(keys) != len(set(keys)):
            duplicate = next(key for key in keys if keys.count(key) > 1)
            raise ValueError(f"duplicate key {duplicate!r}")
        return dict(pairs)

    try:
        text = raw.decode("utf-8")
        value = json.loads(text, parse_constant=_reject_constant, object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProblemError("invalid_request", f"Malformed JSON body: {exc}") from exc
    if isinstance(value, float) and not math.isfinite(value):
        raise ProblemError("invalid_request", "Malformed JSON body.")
    return value


class StrictJSONParser(JSONParser):
    def parse(
        self,
        stream: IO[bytes] | None,
        media_type: str | None = None,
        parser_context: dict | None = None,
    ) -> object:
        raw = stream.read() if stream is not None else b""
        if not raw:
            raise ParseError("the body is empty")
        return loads_strict(raw)
