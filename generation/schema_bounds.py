"""Static bounds on a JSON Schema, checked before xgrammar sees it.

Compiling a schema into a grammar costs time that grows fast with the
schema's nesting (a valid schema 200 levels deep took 9.4 s) and with the
repetitions its regular expressions ask for (``"pattern": "a{10000}"``
took 19 s), and the web process compiles every schema once to check it.
These checks look at the schema alone, in time linear in its size, so that
such a schema is refused at once. The limits are passed in (the settings
``LMSP_MAX_SCHEMA_*`` and ``LMSP_MAX_PATTERN_REPEAT``).
"""

from __future__ import annotations

import json
import re
from typing import Any

_QUANTIFIER = re.compile(r"\{([0-9]+)(?:,([0-9]*))?\}")
_LONGEST_BOUND = 9  # digits; anything longer is over every sensible limit


def _depth(value: object) -> int:
    """Nesting depth of a JSON value (an empty object or array counts 1)."""
    deepest = 0
    pending: list[tuple[object, int]] = [(value, 0)]
    while pending:
        current, level = pending.pop()
        if isinstance(current, dict):
            deepest = max(deepest, level + 1)
            pending.extend((member, level + 1) for member in current.values())
        elif isinstance(current, list):
            deepest = max(deepest, level + 1)
            pending.extend((member, level + 1) for member in current)
    return deepest


def pattern_repeat(pattern: str) -> int:
    """The most times a regular expression repeats one thing, with nested
    counted repetitions multiplied: ``(a{10}){20}`` is 200. ``*`` and ``+``
    are loops in a grammar, not copies, and count 1."""
    costs = [1]  # the costliest atom in each open group
    last = 1  # the cost of the atom a quantifier would apply to
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            last, index = 1, index + 2
        elif char == "[":
            end = index + 1
            if end < len(pattern) and pattern[end] == "^":
                end += 1
            if end < len(pattern) and pattern[end] == "]":
                end += 1
            while end < len(pattern) and pattern[end] != "]":
                end += 2 if pattern[end] == "\\" else 1
            last, index = 1, end + 1
        elif char == "(":
            costs.append(1)
            last, index = 1, index + 1
        elif char == ")":
            last = costs.pop() if len(costs) > 1 else 1
            index += 1
        elif char == "{" and (match := _QUANTIFIER.match(pattern, index)):
            low, high = match.group(1), match.group(2)
            bound_text = high if high else low
            if len(bound_text) > _LONGEST_BOUND or len(low) > _LONGEST_BOUND:
                return int(10**_LONGEST_BOUND)
            last *= max(int(bound_text), int(low), 1)
            index = match.end()
        else:
            last, index = 1, index + 1
        costs[-1] = max(costs[-1], last)
    return max(costs)


def _patterns(schema: object, path: str) -> list[tuple[str, str]]:
    """Every ``pattern`` string in a schema, with its path."""
    found = []
    pending: list[tuple[object, str]] = [(schema, path)]
    while pending:
        current, where = pending.pop()
        if isinstance(current, dict):
            for key, member in current.items():
                if key == "pattern" and isinstance(member, str):
                    found.append((f"{where}.pattern", member))
                else:
                    pending.append((member, f"{where}.{key}"))
        elif isinstance(current, list):
            pending.extend((member, f"{where}[{i}]") for i, member in enumerate(current))
    return found


def schema_bounds_problem(
    schema: dict[str, Any], path: str, *, max_bytes: int, max_depth: int, max_repeat: int
) -> tuple[str, str] | None:
    """The first bound a schema passes, as (param, reason); None if it keeps them."""
    size = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    if size > max_bytes:
        return path, f"The schema is {size} bytes as JSON; at most {max_bytes} are allowed."
    depth = _depth(schema)
    if depth > max_depth:
        return path, f"The schema nests {depth} deep; at most {max_depth} is allowed."
    for where, pattern in _patterns(schema, path):
        repeat = pattern_repeat(pattern)
        if repeat > max_repeat:
            return where, (
                f"The pattern repeats up to {repeat} times; at most {max_repeat} is allowed."
            )
    return None
