"""Constrained decoding with xgrammar: the worker's side of ``generation.schemas``.

The structural tag a request's output must match is built in
``generation.schemas``; here it is compiled against the model's tokenizer
(in a child process with a time and memory limit, then kept in a cache
bounded in entries and bytes) and applied while decoding. Plain text requests need no
constraint: no logits processor, and the model alone decides when it has
finished.

The masks only ever allow text that can still end inside the grammar; once
the grammar is complete only the model's end-of-turn tokens remain, so a
constrained answer cannot end invalid, only be cut by the token limit.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, cast

import torch
import xgrammar as xgr
from django.conf import settings
from transformers import LogitsProcessor

from generation import grammar_limits
from generation.params import GenerationParams
from generation.registry import ModelSpec
from generation.schemas import grammar_format, grammar_limits_from_settings, structural_tag

from .loading import LoadedModel, load_tokenizer
from .upstream import UpstreamModel

# --- compiling (in a child with limits; cached per tokenizer and grammar) ----------


@functools.cache
def _tokenizer_info(spec: ModelSpec, vocab_size: int) -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo.from_huggingface(load_tokenizer(spec), vocab_size=vocab_size)


@functools.cache
def _tokenizer_info_json(spec: ModelSpec, vocab_size: int) -> str:
    serialized: str = _tokenizer_info(spec, vocab_size).serialize_json()
    return serialized


def vocab_size(lm: LoadedModel | UpstreamModel) -> int:
    """The model's vocabulary (its logits' width), which grammars are compiled for."""
    if isinstance(lm, UpstreamModel):
        return lm.vocab_size
    return int(cast(Any, lm.model).config.vocab_size)


class CompiledCache:
    """Compiled grammars by tag, least recently used first out, bounded both in
    entries and in the bytes xgrammar reports for them: one grammar for a big
    schema can take many megabytes, and every distinct schema adds one."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: OrderedDict[tuple[Any, ...], tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self.bytes = 0

    def get(self, key: tuple[Any, ...]) -> xgr.CompiledGrammar | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: tuple[Any, ...], grammar: xgr.CompiledGrammar) -> None:
        size = int(grammar.memory_size_bytes)
        if key in self._items:
            self.bytes -= self._items.pop(key)[1]
        self._items[key] = (grammar, size)
        self.bytes += size
        while len(self._items) > 1 and (
            len(self._items) > self.max_entries or self.bytes > self.max_bytes
        ):
            self.bytes -= self._items.popitem(last=False)[1][1]

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
        self.bytes = 0


_cache = CompiledCache(
    settings.LMSP_GRAMMAR_CACHE_ENTRIES, settings.LMSP_GRAMMAR_CACHE_MB * 1024 * 1024
)


def clear_compiled() -> None:
    """Forget every compiled grammar (benchmarks time the compile itself)."""
    _cache.clear()


# The web compiled the schema within LMSP_GRAMMAR_TIMEOUT_SECONDS before it
# accepted the request; here it is compiled again (and serialized) under
# another load. Twice that time, so that a schema the web accepted near the
# limit is not failed after its acceptance (seen: 4.9 s in the web, over 5 s
# in the worker while it decoded).
WORKER_TIME_FACTOR = 2.0


def _compiled(spec: ModelSpec, vocab_size: int, tag: str) -> xgr.CompiledGrammar:
    """The tag compiled against this model's tokenizer: in a child process within
    ``WORKER_TIME_FACTOR`` x ``LMSP_GRAMMAR_TIMEOUT_SECONDS`` and
    ``LMSP_GRAMMAR_MEMORY_MB``, as the web checked it (raises
    ``grammar_limits.GrammarError`` otherwise), then kept."""
    key = (spec, vocab_size, tag)
    grammar = _cache.get(key)
    if grammar is None:
        info_json = _tokenizer_info_json(spec, vocab_size)
        limits = grammar_limits_from_settings()
        limits = dataclasses.replace(limits, seconds=limits.seconds * WORKER_TIME_FACTOR)
        [serialized] = grammar_limits.compile_tags([tag], info_json, limits, keep=True)
        grammar = xgr.CompiledGrammar.deserialize_json(
            serialized, _tokenizer_info(spec, vocab_size)
        )
        _cache.put(key, grammar)
    return grammar


def structural_tag_of(lm: LoadedModel | UpstreamModel, params: GenerationParams) -> str | None:
    """The structural tag a request's output must match (None: free text)."""
    fmt = grammar_format(params, lm.spec)
    return None if fmt is None else structural_tag(fmt)


def compiled_grammar(
    lm: LoadedModel | UpstreamModel, params: GenerationParams
) -> xgr.CompiledGrammar | None:
    tag = structural_tag_of(lm, params)
    return None if tag is None else _compiled(lm.spec, vocab_size(lm), tag)


def _matcher(
    lm: LoadedModel | UpstreamModel, grammar: xgr.CompiledGrammar, generated: Sequence[int]
) -> xgr.GrammarMatcher:
    # The stop tokens are the ones generate() ends on, so a finished grammar
    # leaves the model nothing to sample but the end of its turn.
    matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=sorted(lm.eos_token_ids))
    for position, token_id in enumerate(generated):
        if not matcher.accept_token(token_id):
            raise ValueError(f"Generated token {token_id} at {position} breaks the grammar.")
    return matcher


# --- decoding --------------------------------------------------------------------


class GrammarLogitsProcessor(LogitsProcessor):  # type: ignore[misc]  # transformers: untyped here
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


def logits_processors(
    lm: LoadedModel, params: GenerationParams, generated: Sequence[int]
) -> list[object]:
    grammar = compiled_grammar(lm, params)
    if grammar is None:
        return []
    matcher = _matcher(lm, grammar, list(generated))
    return [GrammarLogitsProcessor(matcher, vocab_size(lm))]


def ended(
    lm: LoadedModel | UpstreamModel, params: GenerationParams, generated: Sequence[int]
) -> bool:
    """Whether a grammar has reached its end: the answer is complete and only
    an end-of-turn token could follow (true even when none was sampled)."""
    grammar = compiled_grammar(lm, params)
    if grammar is None:
        return False
    matcher = _matcher(lm, grammar, generated)
    if not matcher.is_completed():
        return False
    width = vocab_size(lm)
    bitmask = xgr.allocate_token_bitmask(1, width)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = torch.zeros(width)
    xgr.apply_token_bitmask_inplace(allowed.unsqueeze(0), bitmask)
    return set(torch.isfinite(allowed).nonzero().flatten().tolist()) <= lm.eos_token_ids
