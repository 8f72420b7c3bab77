"""What a request's output must match, as an xgrammar structural tag.

A request's constraint is one structural tag, built from its
``response_format``, ``tools`` and ``tool_choice``:

- a ``json_schema`` answer: JSON valid for the schema, nothing else;
- ``tool_choice`` ``required`` or a named tool: exactly one call
  ``{"name":...,"arguments":...}`` of an allowed tool, its arguments valid
  for that tool's ``parameters``, and nothing after it but the end token:
  the prompt ends with the call's opening tag (``output.opens_call``);
- ``auto``: free text, but once the model writes ``<tool_call>`` the call
  (``<tool_call>\\n{...}\\n</tool_call>``) must be complete and valid (the
  trigger mechanism vLLM uses);
- ``none`` with tools: free text that never opens a call.

Plain text requests need no constraint. The web process checks here that a
request's schemas compile (``schema_problem``) and the worker compiles the
same tag against its tokenizer (``workers.constraints``), both in a child
process with a time and memory limit (``generation.grammar_limits``), so
that the web process never imports xgrammar.
"""

from __future__ import annotations

import json
from typing import Any

from django.conf import settings

from . import grammar_limits
from .output import CALL_OPENING, TOOL_CLOSE, TOOL_OPEN, opens_call
from .params import GenerationParams
from .registry import ModelSpec

# Whitespace between JSON tokens: unbounded whitespace is valid JSON, and
# small models sampled at a high temperature can loop on it forever.
MAX_JSON_WHITESPACE = 1
NO_PARAMETERS = {"type": "object", "properties": {}}
COMPACT_JSON = grammar_limits.COMPACT_JSON


def _json(schema: dict[str, Any]) -> dict[str, Any]:
    """An answer's JSON: one space at most between tokens, as a person writes it."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_JSON_WHITESPACE}


def _compact_json(schema: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments: compact JSON (``{"city":"Paris"}``), no whitespace at
    all, so that the model spends no token on it. Greedy SmolLM2 writes a
    forced ``get_weather(city="Paris")`` in 20 output tokens, end token
    included (19 with the tool named; ``bench/bench_call_tokens.py``): the
    JSON alone, the prompt having opened the call (``output.opens_call``).
    With the tags in the output it took 32, 12 of them on the tags, and 34
    with whitespace allowed.
    xgrammar's structural tags cannot say "no whitespace"
    (``max_whitespace_cnt`` must be positive), so this is our own format,
    turned into a grammar where xgrammar is loaded
    (``generation.grammar_limits.resolve_compact_json``)."""
    return {"type": COMPACT_JSON, "json_schema": schema}


def _call(tool: dict[str, Any], opened: bool = False) -> dict[str, Any]:
    """One tool's call in the Hermes format the output parser reads back, as
    compact JSON: ``<tool_call>\\n{"name":"f","arguments":{"a":1}}\\n</tool_call>``;
    ``opened`` (the prompt ends with ``CALL_OPENING``): the JSON alone."""
    begin = f'{{"name":{json.dumps(tool["name"])},"arguments":'
    return {
        "type": "tag",
        "begin": begin if opened else CALL_OPENING + begin,
        "content": _compact_json(tool.get("parameters") or NO_PARAMETERS),
        "end": "}" if opened else f"}}\n{TOOL_CLOSE}",
    }


def grammar_format(params: GenerationParams, spec: ModelSpec) -> dict[str, Any] | None:
    """The structural tag format a request's output must match, from the model
    of ``spec`` (whose prompt may open a forced call); None for free text."""
    tools, choice = params.tools, params.tool_choice
    answer = _json(params.json_schema) if params.json_schema is not None else None
    if not tools:
        return answer
    if choice == "none":
        return answer or {"type": "any_text", "excludes": [TOOL_OPEN]}
    opened = opens_call(params, spec)
    if isinstance(choice, dict):
        return _call(next(t for t in tools if t["name"] == choice["name"]), opened)
    calls = [_call(tool, opened) for tool in tools]
    if choice == "required":
        return calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    if answer is not None:  # auto with a schema: either a call or the JSON answer
        return {"type": "or", "elements": [*calls, answer]}
    return {"type": "triggered_tags", "triggers": [TOOL_OPEN], "tags": calls}


def structural_tag(fmt: dict[str, Any]) -> str:
    # Keys keep the client's order: xgrammar emits properties in schema order.
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def grammar_limits_from_settings() -> grammar_limits.Limits:
    return grammar_limits.Limits(
        seconds=settings.LMSP_GRAMMAR_TIMEOUT_SECONDS, memory_mb=settings.LMSP_GRAMMAR_MEMORY_MB
    )


def needs_grammar(params: GenerationParams) -> bool:
    """Whether a request has schemas to compile (tools, a JSON schema answer)."""
    return bool(params.tools) or params.json_schema is not None


def schema_problem(
    params: GenerationParams, spec: ModelSpec | None = None
) -> tuple[str, str] | None:
    """The first schema of a request that cannot be compiled, as (param, reason):
    one xgrammar refuses, or one that needs more than ``LMSP_GRAMMAR_TIMEOUT_SECONDS``
    or ``LMSP_GRAMMAR_MEMORY_MB`` to compile.

    Checked in the web process, in a child process (``generation.grammar_limits``)
    so that a hostile schema costs the web nothing but the wait, and in one of
    the process's ``LMSP_GRAMMAR_CONCURRENCY`` compile slots: raises
    ``grammar_limits.CompilerBusy`` when none came free within
    ``LMSP_GRAMMAR_WAIT_SECONDS``. With the model's ``spec`` each schema is
    compiled against its tokenizer, as the worker will (that is where the
    costly compiles are); without one, only the grammar is built.
    """
    schemas: list[tuple[str, dict[str, Any]]] = []
    if params.json_schema is not None:
        schemas.append(("response_format.json_schema.schema", _json(params.json_schema)))
    for index, tool in enumerate(params.tools):
        schemas.append((f"tools[{index}].parameters", _call(tool)))
    if not schemas:
        return None
    info = None
    if spec is not None:
        from .weights import weights_folder

        info = grammar_limits.tokenizer_info(str(weights_folder(spec)))
    tags = [structural_tag(fmt) for _, fmt in schemas]
    slot = grammar_limits.compile_slot(
        settings.LMSP_GRAMMAR_CONCURRENCY, settings.LMSP_GRAMMAR_WAIT_SECONDS
    )
    try:
        with slot:
            grammar_limits.compile_tags(tags, info, grammar_limits_from_settings())
    except grammar_limits.GrammarError as exc:
        param = schemas[exc.index][0]
        return param, f"The schema in {param} cannot be compiled: {exc.reason}."
    return None
