"""What a request's output must match, as an xgrammar structural tag.

A request's constraint is one structural tag, built from its
``response_format``, ``tools`` and ``tool_choice``:

- a ``json_schema`` answer: JSON valid for the schema, nothing else;
- ``tool_choice`` ``required`` or a named tool: exactly one
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` of an allowed
  tool, its arguments valid for that tool's ``parameters``;
- ``auto``: free text, but once the model writes ``<tool_call>`` the call must
  be complete and valid (the trigger mechanism vLLM uses);
- ``none`` with tools: free text that never opens a call.

Plain text requests need no constraint. The web process checks here that a
request's schemas compile (``schema_problem``) and the worker compiles the
same tag against its tokenizer (``workers.constraints``). xgrammar is
imported only when a schema is checked, so that importing this module (and
the web process) stays free of it.
"""

from __future__ import annotations

import json
import re

from .output import TOOL_CLOSE, TOOL_OPEN
from .params import GenerationParams

# Bounds whitespace between JSON tokens: unbounded whitespace is valid JSON,
# and small models sampled at a high temperature can loop on it forever.
MAX_JSON_WHITESPACE = 1
NO_PARAMETERS = {"type": "object", "properties": {}}


def _json(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _call(tool: dict) -> dict:
    """One tool's call in the Hermes format the output parser reads back."""
    return {
        "type": "tag",
        "begin": f'{TOOL_OPEN}\n{{"name": {json.dumps(tool["name"])}, "arguments": ',
        "content": _json(tool.get("parameters") or NO_PARAMETERS),
        "end": f"}}\n{TOOL_CLOSE}",
    }


def grammar_format(params: GenerationParams) -> dict | None:
    """The structural tag format a request's output must match; None for free text."""
    tools, choice = params.tools, params.tool_choice
    answer = _json(params.json_schema) if params.json_schema is not None else None
    if not tools:
        return answer
    if choice == "none":
        return answer or {"type": "any_text", "excludes": [TOOL_OPEN]}
    if isinstance(choice, dict):
        return _call(next(t for t in tools if t["name"] == choice["name"]))
    calls = [_call(tool) for tool in tools]
    if choice == "required":
        return calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if answer is not None:  # auto with a schema: either a call or the JSON answer
        return {"type": "or", "elements": [*calls, answer]}
    return {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": calls}


def structural_tag(fmt: dict) -> str:
    # Keys keep the client's order: xgrammar emits properties in schema order.
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _reason(exc: Exception) -> str:
    # xgrammar prefixes its messages with a time and a C++ source location.
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return text.splitlines()[0] if text else exc.__class__.__name__


def schema_problem(params: GenerationParams) -> tuple[str, str] | None:
    """The first schema of a request xgrammar cannot compile, as (param, reason).

    Checked in the web process, with no tokenizer: turning a schema into a
    grammar is where schemas fail; the worker then compiles the same text.
    """
    import xgrammar as xgr

    schemas: list[tuple[str, dict]] = []
    if params.json_schema is not None:
        schemas.append(("response_format.json_schema.schema", _json(params.json_schema)))
    for index, tool in enumerate(params.tools):
        schemas.append((f"tools[{index}].parameters", _call(tool)))
    for param, fmt in schemas:
        try:
            xgr.Grammar.from_structural_tag(structural_tag(fmt))
        except (RuntimeError, ValueError) as exc:
            return param, f"The schema in {param} cannot be compiled: {_reason(exc)}"
    return None
