"""The worker's side of a model served by an upstream server (``[models.upstream]``).

Why a module of its own: such a model needs no weights, no torch model and
no batching engine in the worker, only its tokenizer (lmsp renders the
prompt, counts it, and turns the returned token ids into text) and the
HTTP client of ``engine.upstream``, which implements the same
``engine.interface.EngineClient`` as the own engine. Here are the model as
the runner holds it (``UpstreamModel``), the process's one client per model,
and the request the runner submits to it (``request_for``).

The API key is read from the environment (``api_key_env``) when the client
is made, and goes nowhere else.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from django.conf import settings

from engine.interface import Constraint, EngineRequest, SamplingParams
from engine.upstream import UpstreamEngine, UpstreamServer
from generation.registry import TEXT_ENGINES, ModelSpec
from generation.schemas import grammar_format, structural_tag
from generation.weights import weights_folder
from ops_app import upstream_health

from .loading import load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from generation.params import GenerationParams


class UpstreamRefused(Exception):
    """The upstream server refused the request (a 4xx): its message, for the task's error."""


@dataclass
class UpstreamModel:
    """A model as the runner holds it when another server generates for it."""

    spec: ModelSpec
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: set[int]
    vocab_size: int  # the logits' width, which grammars are compiled for


@functools.cache
def load_upstream(spec: ModelSpec) -> UpstreamModel:
    """Its tokenizer, end tokens and vocabulary, from its folder: no weights."""
    from transformers import AutoConfig, GenerationConfig

    folder = weights_folder(spec)
    tokenizer = load_tokenizer(spec)
    config = AutoConfig.from_pretrained(folder)
    ids = GenerationConfig.from_pretrained(folder).eos_token_id
    eos = {*(ids if isinstance(ids, list) else [ids]), tokenizer.eos_token_id}
    return UpstreamModel(spec, tokenizer, {i for i in eos if i is not None}, int(config.vocab_size))


@dataclass(frozen=True)
class TokenizerText:
    """``engine.upstream.TextCodec`` over the model's tokenizer, for a server
    asked in text (``engine = "openai"``)."""

    tokenizer: PreTrainedTokenizerBase
    eos_token_id: int

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.tokenizer.decode(
                list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
            )
        )


@functools.cache
def upstream_engine(spec: ModelSpec) -> UpstreamEngine:
    """The process's one client for the model's server."""
    upstream = spec.upstream
    assert upstream is not None, f"{spec.id} has no upstream"
    api_key = os.environ.get(upstream.api_key_env, "") if upstream.api_key_env else ""
    text = None
    if upstream.engine in TEXT_ENGINES:
        tokenizer = load_upstream(spec).tokenizer
        text = TokenizerText(tokenizer, int(tokenizer.eos_token_id))
    return UpstreamEngine(
        UpstreamServer(
            base_url=upstream.base_url,
            model=upstream.model,
            api_key=api_key,
            max_concurrency=spec.max_batch,
            connect_timeout=upstream.connect_timeout_seconds,
            read_timeout=upstream.read_timeout_seconds,
        ),
        text,
    )


def watch_health(spec: ModelSpec) -> threading.Thread:
    """Probe the model's server every ``upstream_health.PROBE_INTERVAL_SECONDS``
    for as long as this worker runs, recording each outcome (``/readyz``,
    ``/metrics`` and the admin read them)."""
    client = upstream_engine(spec)

    def watch() -> None:
        while True:
            upstream_health.record(spec.id, client.probe())
            time.sleep(upstream_health.PROBE_INTERVAL_SECONDS)

    watcher = threading.Thread(target=watch, name=f"upstream-health-{spec.id}", daemon=True)
    watcher.start()
    return watcher


def owner_salt(spec: ModelSpec, owner_id: int) -> str:
    """vLLM's ``cache_salt`` for an owner's requests: unguessable (vLLM asks for
    that), their own unless the model's cache is shared (then none)."""
    if spec.share_prefix_cache:
        return ""
    key = settings.SECRET_KEY.encode()
    return hmac.new(key, f"owner:{owner_id}".encode(), hashlib.sha256).hexdigest()


def _seed(response_id: str) -> int:
    return int.from_bytes(hashlib.sha256(response_id.encode()).digest()[:4], "big")


def request_for(
    model: UpstreamModel,
    request_id: str,
    prompt_ids: Sequence[int],
    sampling: SamplingParams,
    *,
    generated_ids: Sequence[int],
    params: GenerationParams,
    priority: int,
    owner_id: int,
    response_id: str,
) -> EngineRequest:
    """The prompt and the tokens generated so far, as token ids: the server
    goes on from exactly there. A constrained request carries a seed of its
    response's own, the same at every attempt, so that vLLM can give its
    answer's first tokens again (``engine.upstream``)."""
    from generation.grammar_limits import resolve_compact_json

    fmt = grammar_format(params, model.spec)
    constraint = None
    if fmt is not None:  # lmsp's own compact-JSON format made a grammar vLLM reads
        constraint = Constraint(structural_tag(resolve_compact_json(fmt)))  # type: ignore[arg-type]
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=(*prompt_ids, *generated_ids),
        sampling=replace(sampling, seed=None if constraint is None else _seed(response_id)),
        constraint=constraint,
        resumed_tokens=len(generated_ids),
        priority=priority,
        cache_salt=owner_salt(model.spec, owner_id),
    )
