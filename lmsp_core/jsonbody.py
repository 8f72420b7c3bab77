"""A JSON parser that refuses what Python's json module would let through.

Request bodies are parsed here and nowhere else, so this is where every value
that could not be stored or computed with is refused, with the path of the
member at fault (``param``): invalid UTF-8, duplicate keys, NaN and Infinity,
numbers that overflow to infinity (``1e999``) or are thousands of digits
long, integers outside 64 bits, U+0000 and lone surrogates (PostgreSQL
stores neither), and nesting deeper than ``LMSP_MAX_JSON_DEPTH`` (checked on
the raw bytes before parsing, so that a 3,000-deep body never reaches the
recursive parser).

Every check takes time linear in the body, whatever its bytes, in a few
passes of C code (``bytes`` methods, ``itertools.accumulate``, regular
expressions that cannot backtrack, ``json.loads``); Python runs only per
object (the duplicate-key check) and per suspect literal. The costliest
megabytes measured here (a body of quotes, of empty arrays, of numbers)
take about 0.1 s, in steps that hold the GIL for tens of milliseconds at
most, so the other requests of the process go on meanwhile. (A regular
expression that failed on an unterminated string, and was tried again from
every quote after it, once took time quadratic in the body: seconds for
30 KB, hours for a megabyte; issue 29.) The member at fault is named
without a walk of the parsed value: the body is cut where the fault is,
closed, and parsed again (``_RawBody.member_path``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import cached_property
from itertools import accumulate, repeat
from operator import indexOf
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
_LONGEST_KEY_IN_PARAM = 64

# --- the body's structure, on the raw bytes ---------------------------------------

# Every byte of a string's contents, made a space.
_BLANKED = b" " * 256
# Depth steps of JSON's own brackets (a signed byte each: 0xff is -1).
_DEPTH_STEP = bytes(
    {ord("["): 1, ord("{"): 1, ord("]"): 0xFF, ord("}"): 0xFF}.get(byte, 0) for byte in range(256)
)
_CLOSER = bytes.maketrans(b"[{", b"]}")
_COLON_NEXT = re.compile(rb"[ \t\n\r]*:")
# Literals that may be refused: NaN and Infinity, runs of number characters
# of 19 or more (the shortest integer outside 64 bits), exponents of three
# digits or more (the shortest overflow). No alternative can backtrack: each
# fails within a few bytes of where it was tried, or matches a whole run.
_SUSPECT_LITERAL = re.compile(rb"NaN|-?Infinity|(?<![-+.0-9eE])[-+.0-9eE]{19,}|[eE][-+]?[0-9]{3,}")
# Trying that at every byte costs about 80 ns a byte; these show in a few
# milliseconds a megabyte whether it can match at all (see refused_literal).
_NUMBER_CHAR = bytes.maketrans(b"-+.0123456789eE", b"1" * 15)
_EXPONENT_MARK = bytes.maketrans(b"eE+-0123456789", b"ee" + b"s" * 2 + b"d" * 10)
_NUMBER_CHARS = frozenset(b"-+.0123456789eE")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
# Escapes that decode to what PostgreSQL cannot store: U+0000, and a
# surrogate that is not half of a pair (found once the pairs are blanked).
_SURROGATE_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_UNSTORABLE_ESCAPE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")


class _Members(list[tuple[str, object]]):
    """An object's members as parsed by ``member_path``: in order, duplicates kept."""


class _RawBody:
    """A body's bytes, and views of them in which JSON's structure shows at
    the same offsets (each computed once, when a check needs it)."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    @cached_property
    def unescaped(self) -> bytes:
        """The body with the escapes ``\\\\`` and ``\\"`` blanked: its quotes
        are the strings' own. (A run of backslashes in a string pairs from its
        start, as bytes.replace does; a valid body has none outside strings.)"""
        return self.raw.replace(b"\\\\", b"  ").replace(b'\\"', b"  ")

    @cached_property
    def structure(self) -> bytes:
        """``unescaped`` with every string's contents blanked: the brackets,
        numbers and literals left are JSON's own."""
        parts = self.unescaped.split(b'"')
        parts[1::2] = list(map(bytes.translate, parts[1::2], repeat(_BLANKED)))
        return b'"'.join(parts)

    @cached_property
    def steps(self) -> memoryview:
        """What each byte adds to the nesting depth: 1, -1 or 0."""
        return memoryview(self.structure.translate(_DEPTH_STEP)).cast("b")

    def too_deep(self, limit: int) -> int | None:
        """Where a bracket first nests past ``limit`` (the offset of that
        bracket), or None. ``-1`` when it does but the brackets never close:
        the body is cut short or unbalanced."""
        for text in (self.raw, self.structure):  # the second: brackets in strings left out
            if text.count(b"[") + text.count(b"{") <= limit:
                return None
        try:
            offset = indexOf(accumulate(self.steps), limit + 1)
        except ValueError:
            return None
        return offset if sum(self.steps) == 0 else -1

    def member_path(self, offset: int, *, key: bool = False) -> str | None:
        """The path of the value that starts at ``offset`` (with ``key``: of
        the object whose member name starts there), or None when the body
        before it is not valid JSON.

        The body is cut at ``offset``, a ``0`` (or a member ``"":0``) put
        there, the brackets still open closed, and the result parsed: the
        path is that of the last member at every level.
        """
        steps = self.steps[:offset]
        level = sum(steps)
        # Going back from offset, the bracket that opened each level is where
        # the depth first falls below it.
        back = accumulate(steps[::-1])
        openers = bytearray()
        at = offset
        for rise in range(1, level + 1):
            at -= indexOf(back, rise) + 1
            openers.append(self.structure[at])
        cut = self.raw[:offset] + (b'"":0' if key else b"0") + openers.translate(_CLOSER)
        try:
            node = json.loads(
                cut,
                object_pairs_hook=_Members,
                parse_int=str,
                parse_float=str,
                parse_constant=str,
            )
        except (ValueError, RecursionError):
            return None
        path = ""
        for _ in range(level - 1 if key else level):
            if isinstance(node, _Members) and node:
                name, node = node[-1]
                path = _child(path, name)
            elif isinstance(node, list) and node:
                path = _child(path, len(node) - 1)
                node = node[-1]
            else:
                return None
        return path

    def refused_literal(self) -> tuple[int, str] | None:
        """The offset of the first literal refused, and why."""
        structure = self.structure
        marks = structure.translate(_EXPONENT_MARK)
        if not (
            b"NaN" in structure
            or b"Infinity" in structure
            or b"1" * 19 in structure.translate(_NUMBER_CHAR)
            or b"eddd" in marks
            or b"esddd" in marks
        ):
            return None
        for match in _SUSPECT_LITERAL.finditer(structure):
            start, end = match.span()
            while start and structure[start - 1] in _NUMBER_CHARS:  # an exponent's number
                start -= 1
            reason = _refusal(structure[start:end].decode("ascii"))
            if reason is not None:
                return start, reason
        return None

    def unstorable_string(self) -> tuple[int, bool] | None:
        """Where the first string holding U+0000 or a lone surrogate starts,
        and whether it is a member name."""
        if _UNSTORABLE_ESCAPE.search(self.raw) is None:  # what the escapes can hide, only less
            return None
        unpaired = _SURROGATE_PAIR.sub(b" " * 12, self.unescaped)
        found = _UNSTORABLE_ESCAPE.search(unpaired)
        if found is None:
            return None
        start = self.unescaped.rfind(b'"', 0, found.start())
        end = self.unescaped.find(b'"', found.end())
        return start, _COLON_NEXT.match(self.unescaped, end + 1) is not None


def _refusal(literal: str) -> str | None:
    if literal in ("NaN", "Infinity", "-Infinity"):
        return f"{literal}, which is not valid JSON"
    if len(literal) > MAX_NUMBER_CHARS:
        return f"a number {len(literal)} characters long (at most {MAX_NUMBER_CHARS})"
    if _JSON_NUMBER.fullmatch(literal) is None:
        return None  # not a number: the parser says what is wrong
    if any(mark in literal for mark in ".eE"):
        if float(literal) in (float("inf"), float("-inf")):
            return f"a number too large to represent ({literal})"
    elif not INT_MIN <= int(literal) <= INT_MAX:
        return "an integer outside the 64-bit range"
    return None


def _key_in_param(key: str) -> str:
    if len(key) > _LONGEST_KEY_IN_PARAM:
        return key[:_LONGEST_KEY_IN_PARAM] + "..."
    return key


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    key = _key_in_param(key)
    return f"{path}.{key}" if path else key


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    members = dict(pairs)
    if len(members) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise ValueError(f"duplicate key {key[:_LONGEST_KEY_IN_PARAM]!r}")
            seen.add(key)
    return members


def _refused(path: str | None, reason: str) -> ProblemError:
    param = path or "body"
    return ProblemError("invalid_request", f"{param}: {reason}.", param=param)


def loads_strict(raw: bytes) -> object:
    """Parse a request body: UTF-8 JSON, no NaN/Infinity, no duplicate keys,
    nothing PostgreSQL cannot store, at most ``LMSP_MAX_JSON_DEPTH`` deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProblemError(
            "invalid_request", f"Malformed JSON body: not UTF-8 ({exc.reason}).", param="body"
        ) from exc
    body = _RawBody(raw)
    limit = settings.LMSP_MAX_JSON_DEPTH
    deep = body.too_deep(limit)
    if deep == -1:
        raise ProblemError(
            "invalid_request", f"Malformed JSON body: nested more than {limit} deep.", param="body"
        )
    if deep is not None:
        raise _refused(body.member_path(deep), f"arrays and objects nest more than {limit} deep")
    literal = body.refused_literal()
    if literal is not None and (path := body.member_path(literal[0])) is not None:
        raise _refused(path, literal[1])
    try:
        value = json.loads(text, object_pairs_hook=_no_duplicates)
    except RecursionError as exc:  # not past the depth check; kept as a guard
        raise ProblemError(
            "invalid_request", f"Malformed JSON body: nested more than {limit} deep.", param="body"
        ) from exc
    except ValueError as exc:
        raise ProblemError("invalid_request", f"Malformed JSON body: {exc}", param="body") from exc
    if literal is not None:  # where the body before it is no JSON, yet it parsed
        raise _refused(None, literal[1])
    unstorable = body.unstorable_string()
    if unstorable is not None:
        start, is_key = unstorable
        path = body.member_path(start, key=is_key) or ""
        if is_key:
            raise _refused(path, "a member name contains U+0000 or a lone surrogate")
        raise _refused(path, "the text contains U+0000 or a lone surrogate, which cannot be stored")
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
