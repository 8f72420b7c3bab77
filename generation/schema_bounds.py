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
from collections.abc import Iterator
from typing import Any

# pattern_repeat reads a regular expression with Python only at its groups and
# counted repetitions: escapes and character classes (each one atom, whatever
# it holds) are made a plain atom first, and the rest is atoms too.
_ATOM = re.compile(r"\\.?|\[\^?\]?(?:\\.?|[^\]\\])*\]?", re.S)
_GROUP_OR_COUNT = re.compile(r"[()]|\{([0-9]+)(?:,([0-9]*))?\}")
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
    if "{" not in pattern:  # no counted repetition: nothing repeats
        return 1
    costs = [1]  # the costliest atom in each open group
    last = 1  # the cost of the atom a quantifier would apply to
    seen = 0  # where the last token ended: anything between is atoms
    for token in _GROUP_OR_COUNT.finditer(_ATOM.sub("a", pattern)):
        if token.start() > seen:
            last = 1
        seen = token.end()
        if token.group() == "(":
            costs.append(1)
            last = 1
        elif token.group() == ")":
            last = costs.pop() if len(costs) > 1 else 1
        else:
            low, high = token.group(1), token.group(2)
            bound_text = high if high else low
            if len(bound_text) > _LONGEST_BOUND or len(low) > _LONGEST_BOUND:
                return int(10**_LONGEST_BOUND)
            last *= max(int(bound_text), int(low), 1)
        costs[-1] = max(costs[-1], last)
    return max(costs)


# A member's place: its parent's and its own key or index (None: the schema).
_Where = tuple["_Where", str | int] | None


def _patterns(schema: object) -> Iterator[tuple[str, _Where]]:
    """Every ``pattern`` string in a schema, with where it is (``_path``
    spells that out: built for every member, paths would cost the schema's
    size times its depth times the length of its keys)."""
    pending: list[tuple[object, _Where]] = [(schema, None)]
    while pending:
        current, where = pending.pop()
        if isinstance(current, dict):
            for key, member in current.items():
                if key == "pattern" and isinstance(member, str):
                    yield member, (where, key)
                else:
                    pending.append((member, (where, key)))
        elif isinstance(current, list):
            pending.extend((member, (where, index)) for index, member in enumerate(current))


def _path(path: str, where: _Where) -> str:
    steps: list[str | int] = []
    while where is not None:
        where, step = where
        steps.append(step)
    for step in reversed(steps):
        path += f"[{step}]" if isinstance(step, int) else f".{step}"
    return path


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
    for pattern, where in _patterns(schema):
        repeat = pattern_repeat(pattern)
        if repeat > max_repeat:
            return _path(path, where), (
                f"The pattern repeats up to {repeat} times; at most {max_repeat} is allowed."
            )
    return None
