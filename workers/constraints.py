"""Constrained decoding (grammars for tool calls and JSON schemas), with xgrammar.

A request's constraint is one xgrammar structural tag, built from its
``response_format``, ``tools`` and ``tool_choice``:

- a ``json_schema`` answer: JSON valid for the schema, nothing else;
- ``tool_choice`` ``required`` or a named tool: exactly one
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` of an allowed
  tool, its arguments valid for that tool's ``parameters``;
- ``auto``: free text, but once the model writes ``<tool_call>`` the call must
  be complete and valid (the trigger mechanism vLLM uses);
- ``none`` with tools: free text that never opens a call.

Plain text requests need no constraint: no logits processor, and the model
alone decides when it has finished.

The masks only ever allow text that can still end inside the grammar; once
the grammar is complete only the model's end-of-turn tokens remain, so a
constrained answer cannot end invalid, only be cut by the token limit.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

import torch
import xgrammar as xgr
from transformers import LogitsProcessor

from .loading import LoadedModel, load_tokenizer
from .output import TOOL_CLOSE, TOOL_OPEN
from .registry import ModelSpec

# Bounds whitespace between JSON tokens: unbounded whitespace is valid JSON,
# and small models sampled at a high temperature can loop on it forever.
MAX_JSON_WHITESPACE = 1
NO_PARAMETERS = {"type": "object", "properties": {}}


# --- what a request allows -----------------------------------------------------


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


def grammar_format(params: dict) -> dict | None:
    """The structural tag format a request's output must match; None for free text."""
    tools = params.get("tools") or []
    choice = params.get("tool_choice", "auto")
    response_format = params.get("response_format") or {"type": "text"}
    answer = (
        _json(response_format["json_schema"]["schema"])
        if response_format["type"] == "json_schema"
        else None
    )
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


def _structural_tag(fmt: dict) -> str:
    # Keys keep the client's order: xgrammar emits properties in schema order.
    return json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)


def _reason(exc: Exception) -> str:
    # xgrammar prefixes its messages with a time and a C++ source location.
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(exc).strip())
    return text.splitlines()[0] if text else exc.__class__.__name__


def schema_problem(params: dict) -> tuple[str, str] | None:
    """The first schema of a request xgrammar cannot compile, as (param, reason).

    Checked in the web process, with no tokenizer: turning a schema into a
    grammar is where schemas fail; the worker then compiles the same text.
    """
    schemas: list[tuple[str, dict]] = []
    response_format = params.get("response_format") or {"type": "text"}
    if response_format["type"] == "json_schema":
        schemas.append(
            ("response_format.json_schema.schema", _json(response_format["json_schema"]["schema"]))
        )
    for index, tool in enumerate(params.get("tools") or []):
        schemas.append((f"tools[{index}].parameters", _call(tool)))
    for param, fmt in schemas:
        try:
            xgr.Grammar.from_structural_tag(_structural_tag(fmt))
        except (RuntimeError, ValueError) as exc:
            return param, f"The schema in {param} cannot be compiled: {_reason(exc)}"
    return None


# --- compiling (cached per tokenizer and grammar) ----------------------------------


@functools.cache
def _compiler(spec: ModelSpec, vocab_size: int) -> xgr.GrammarCompiler:
    info = xgr.TokenizerInfo.from_huggingface(load_tokenizer(spec), vocab_size=vocab_size)
    return xgr.GrammarCompiler(info)


@functools.lru_cache(maxsize=256)
def _compiled(spec: ModelSpec, vocab_size: int, tag: str) -> xgr.CompiledGrammar:
    return _compiler(spec, vocab_size).compile_structural_tag(tag)


def compiled_grammar(lm: LoadedModel, params: dict) -> xgr.CompiledGrammar | None:
    fmt = grammar_format(params)
    if fmt is None:
        return None
    return _compiled(lm.spec, lm.model.config.vocab_size, _structural_tag(fmt))


def _matcher(lm: LoadedModel, grammar: xgr.CompiledGrammar, generated: Sequence[int]):  # noqa: ANN202
    # The stop tokens are the ones generate() ends on, so a finished grammar
    # leaves the model nothing to sample but the end of its turn.
    matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=sorted(lm.eos_token_ids))
    for position, token_id in enumerate(generated):
        if not matcher.accept_token(token_id):
            raise ValueError(f"Generated token {token_id} at {position} breaks the grammar.")
    return matcher


# --- decoding --------------------------------------------------------------------


class GrammarLogitsProcessor(LogitsProcessor):
    """Masks each step's logits to the tokens the grammar allows next.

    Stateful, one per ``generate()`` call. The matcher starts advanced
    through the tokens an earlier attempt generated, which ``generate()``
    receives as part of the prompt; from then on each call first accepts the
    token sampled in the step before.
    """

    def __init__(self, matcher: xgr.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.started = False

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.started:
            token_id = int(input_ids[0, -1])
            if not self.matcher.accept_token(token_id):
                raise RuntimeError(f"Sampled token {token_id} breaks the grammar.")
        self.started = True
        if self.matcher.fill_next_token_bitmask(self.bitmask):
            xgr.apply_token_bitmask_inplace(scores, self.bitmask.to(scores.device))
        return scores


def logits_processors(lm: LoadedModel, params: dict, generated: Sequence[int]) -> list[object]:
    grammar = compiled_grammar(lm, params)
    if grammar is None:
        return []
    matcher = _matcher(lm, grammar, list(generated))
    return [GrammarLogitsProcessor(matcher, lm.model.config.vocab_size)]


def ended(lm: LoadedModel, params: dict, generated: Sequence[int]) -> bool:
    """Whether a grammar has reached its end: the answer is complete and only
    an end-of-turn token could follow (true even when none was sampled)."""
    grammar = compiled_grammar(lm, params)
    if grammar is None:
        return False
    matcher = _matcher(lm, grammar, generated)
    if not matcher.is_completed():
        return False
    vocab_size = lm.model.config.vocab_size
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = torch.zeros(vocab_size)
    xgr.apply_token_bitmask_inplace(allowed.unsqueeze(0), bitmask)
    return set(torch.isfinite(allowed).nonzero().flatten().tolist()) <= lm.eos_token_ids
