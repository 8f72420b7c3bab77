"""The model runner: executes a scheduler's ``StepPlan`` on the model and
samples the next token of each request that asked for one.

Why a runner of its own: the scheduler (``scheduler``) decides in plain
Python; everything that touches tensors is here, so that a faster way to run
a step (another memory layout, compiled kernels, CUDA graphs) is a change to
this module alone.

How a step runs: the chunks of the plan (a decoding row's one token, a
prompt's chunk) are packed end to end into one sequence and go through the
model in one forward pass, so every weight is read once per step whatever
the mix, and no padding is computed. Attention is the one part that must
tell the requests apart: the model's attention layers call ``_attention``
(registered with transformers as ``lmsp_sdpa`` / ``lmsp_eager``), which
writes each chunk's keys and values into its request's own memory
(``KVStore``) and attends over that request's tokens alone, with the
kernel transformers would use (its ``sdpa`` or ``eager`` function; a row
needing no mask calls torch's attention directly, as ``sdpa`` would).

Each request's keys and values live in one tensor pair of its own
(``[layers, kv_heads, capacity, head_dim]``), grown ``GROW_TOKENS`` at a
time: a row's attention reads a slice of it, never a gathered copy. A
finished request's memory becomes a prefix-cache entry as it is (no copy);
a request that starts with a cached prefix, or with what a running request
has computed, gets a copy of that prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xgrammar as xgr
from transformers import AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask, sdpa_mask
from transformers.models.llama.modeling_llama import eager_attention_forward

from .scheduler import Adopt, Chunk, MemoryOp, Release, Request, Share, StepPlan

log = logging.getLogger(__name__)

# Memory is grown this many tokens at a time: a generation of n tokens is
# copied n / GROW_TOKENS times, and holds at most this many tokens unused.
GROW_TOKENS = 256

Kernel = Callable[..., tuple[torch.Tensor, Any]]
KERNELS: dict[str, Kernel] = {"sdpa": sdpa_attention_forward, "eager": eager_attention_forward}
_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
# Given to the model as its attention mask in the engine's own calls: an
# already prepared (4D) mask is taken as it is, so the model builds none of
# its own; ``_attention`` masks each row itself.
_ROWS_MASK_THEMSELVES = torch.ones((1, 1, 1, 1), dtype=torch.bool)


def head_dim(config: PretrainedConfig) -> int:
    return int(
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )


def kv_bytes_per_token(config: PretrainedConfig, dtype_bytes: int) -> int:
    """Bytes of keys and values one token holds, all layers together."""
    per_layer = 2 * int(config.num_key_value_heads) * head_dim(config) * dtype_bytes
    return int(config.num_hidden_layers) * per_layer


def attention_implementation(kernel: str) -> str:
    """The name to load a model with so that the engine can batch it
    (``attention`` in models.toml picks the kernel)."""
    if kernel not in KERNELS:
        raise ValueError(f"Unknown attention kernel {kernel!r} (one of {sorted(KERNELS)}).")
    return f"lmsp_{kernel}"


@dataclass(eq=False)
class KV:
    """One request's (or cache entry's) keys and values, all layers."""

    keys: torch.Tensor  # [layers, kv_heads, capacity, head_dim]
    values: torch.Tensor

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[2])


class KVStore:
    """The memory of the requests being run and of the prefix cache's entries."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.shape = (layers, kv_heads, 0, head_dim)
        self.dtype = dtype
        self.device = device
        self.requests: dict[int, KV] = {}
        self.entries: dict[int, KV] = {}
        self.allocated_tokens = 0  # the capacity of all the tensors above
        self.peak_allocated_tokens = 0

    def _new(self, capacity: int) -> KV:
        layers, heads, _, dim = self.shape
        capacity = -(-capacity // GROW_TOKENS) * GROW_TOKENS
        size = (layers, heads, capacity, dim)
        self.allocated_tokens += capacity
        self.peak_allocated_tokens = max(self.peak_allocated_tokens, self.allocated_tokens)
        return KV(
            torch.empty(size, dtype=self.dtype, device=self.device),
            torch.empty(size, dtype=self.dtype, device=self.device),
        )

    def room(self, request_id: int, tokens: int, keep: int) -> KV:
        """The memory of ``request_id`` with room for ``tokens``, its first ``keep`` kept."""
        kv = self.requests.get(request_id)
        if kv is not None and kv.capacity >= tokens:
            return kv
        grown = self._new(max(tokens, (kv.capacity if kv else 0) + GROW_TOKENS))
        if kv is not None:
            grown.keys[:, :, :keep] = kv.keys[:, :, :keep]
            grown.values[:, :, :keep] = kv.values[:, :, :keep]
            self.allocated_tokens -= kv.capacity
        self.requests[request_id] = grown
        return grown

    def apply(self, op: MemoryOp) -> None:
        if isinstance(op, Adopt | Share):
            source = (
                self.entries[op.entry_id] if isinstance(op, Adopt) else self.requests[op.source_id]
            )
            kv = self.requests[op.request_id] = self._new(op.room)
            kv.keys[:, :, : op.tokens] = source.keys[:, :, : op.tokens]
            kv.values[:, :, : op.tokens] = source.values[:, :, : op.tokens]
        elif isinstance(op, Release):
            released = self.requests.pop(op.request_id, None)
            if op.entry_id is not None and released is not None:
                self.entries[op.entry_id] = released
            elif released is not None:
                self.allocated_tokens -= released.capacity
        else:
            evicted = self.entries.pop(op.entry_id, None)
            if evicted is not None:
                self.allocated_tokens -= evicted.capacity


@dataclass(frozen=True)
class _Row:
    """Where one chunk sits in a step: its slice of the packed sequence, the
    mask its queries need, and views of its request's memory over every
    layer (made once a step, so a layer only picks its own): where its new
    keys and values go, and all of its keys and values up to them."""

    begin: int  # its slice of the packed sequence
    end: int
    mask: torch.Tensor | None
    new_keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    new_values: torch.Tensor
    keys: torch.Tensor  # [layers, 1, kv_heads, start + tokens, head_dim]
    values: torch.Tensor

    @classmethod
    def of(cls, kv: KV, start: int, begin: int, end: int, mask: torch.Tensor | None) -> _Row:
        stop = start + end - begin
        return cls(
            begin,
            end,
            mask,
            kv.keys[:, :, start:stop],
            kv.values[:, :, start:stop],
            kv.keys[:, None, :, :stop],
            kv.values[:, None, :, :stop],
        )


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    kernel: Kernel,
    lmsp_rows: Sequence[_Row] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The model's attention in an engine step: each row's new keys and values
    stored, then its queries attend over its own tokens. Called without rows
    (a plain ``model(...)`` or ``generate``), it is the kernel itself.

    A row that needs no mask (a decoding row, a prompt's first chunk) under
    the ``sdpa`` kernel calls torch's attention directly, with the arguments
    transformers' ``sdpa`` function would give it: its checks and reshapes
    cost more than the attention of one token, and they were paid for every
    row of every layer."""
    if lmsp_rows is None:
        return kernel(module, query, key, value, attention_mask, **kwargs)
    layer = module.layer_idx
    direct = kernel is sdpa_attention_forward and kwargs.get("position_bias") is None
    gqa = getattr(module, "num_key_value_groups", 1) > 1
    outputs = []  # [1, heads, tokens, head_dim] each
    for row in lmsp_rows:
        row.new_keys[layer].copy_(key[0, :, row.begin : row.end])
        row.new_values[layer].copy_(value[0, :, row.begin : row.end])
        rows_query = query[:, :, row.begin : row.end]
        if direct and row.mask is None:
            outputs.append(
                torch.nn.functional.scaled_dot_product_attention(
                    rows_query,
                    row.keys[layer],
                    row.values[layer],
                    scale=kwargs.get("scaling"),
                    is_causal=row.end - row.begin > 1,
                    enable_gqa=gqa,
                )
            )
        else:
            output, _ = kernel(
                module, rows_query, row.keys[layer], row.values[layer], row.mask, **kwargs
            )
            outputs.append(output.transpose(1, 2))
    joined = torch.cat(outputs, dim=2) if len(outputs) > 1 else outputs[0]
    return joined.transpose(1, 2), None


def _register() -> None:
    for name, kernel in KERNELS.items():

        def attention(*args: Any, kernel: Kernel = kernel, **kwargs: Any) -> tuple[Any, Any]:
            return _attention(*args, kernel=kernel, **kwargs)

        AttentionInterface.register(f"lmsp_{name}", attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(f"lmsp_{name}", _MASKS[name])


_register()


@dataclass
class RowSampling:
    """How one request picks its tokens (the scheduler's ``Request.payload``)."""

    temperature: float  # 0: greedy
    grammar: xgr.CompiledGrammar | None = None
    generated_ids: Sequence[int] = ()  # tokens of earlier attempts, for the matcher
    matcher: xgr.GrammarMatcher | None = field(default=None, repr=False)


def row_sampling(request: Request) -> RowSampling:
    """A request's sampling settings (its ``payload``: the engine puts them there)."""
    assert isinstance(request.payload, RowSampling)
    return request.payload


@dataclass
class StepResult:
    sampled: dict[int, int]  # request id -> token id
    failed: dict[int, BaseException]  # requests that failed alone (their grammar)


class ModelRunner:
    """Runs plans on one loaded model."""

    def __init__(self, model: torch.nn.Module, max_batch: int) -> None:
        config = model.config
        self.model = model
        self.kernel = config._attn_implementation.removeprefix("lmsp_")
        if self.kernel not in KERNELS:
            raise ValueError("Load the model with attention_implementation(...) to batch it.")
        self.device = model.device
        self.vocab_size = config.vocab_size
        self.store = KVStore(
            config.num_hidden_layers,
            config.num_key_value_heads,
            head_dim(config),
            model.dtype,
            self.device,
        )
        self._bitmask = xgr.allocate_token_bitmask(max_batch, self.vocab_size)

    def apply(self, memory_ops: list[MemoryOp]) -> None:
        """Move memory as the scheduler decided: copy cached or running
        prefixes, keep or free what ended requests held, evict cache entries."""
        for op in memory_ops:
            self.store.apply(op)

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's memory operations, compute its chunks, and sample
        for the chunks that end their request's input."""
        self.apply(plan.memory_ops)
        failed: dict[int, BaseException] = {}
        chunks = [chunk for chunk in plan.chunks if self._start_matcher(chunk, failed)]
        if not chunks:
            return StepResult({}, failed)
        sampling = [chunk for chunk in chunks if chunk.sample]
        rows: list[_Row] = []
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for chunk in chunks:
            begin = len(ids)
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + len(chunk.token_ids))
            stop = chunk.start + len(chunk.token_ids)
            kv = self.store.room(chunk.request.id, stop, chunk.start)
            rows.append(_Row.of(kv, chunk.start, begin, len(ids), self._mask(chunk)))
            if chunk.sample:
                last.append(len(ids) - 1)
        device = self.device
        output = self.model(
            input_ids=torch.tensor([ids], device=device),
            position_ids=torch.tensor([positions], device=device),
            attention_mask=_ROWS_MASK_THEMSELVES,
            use_cache=False,
            logits_to_keep=torch.tensor(last, dtype=torch.long, device=device),
            lmsp_rows=rows,
        )
        if not sampling:
            return StepResult({}, failed)
        token_ids = self._choose(output.logits[0], [row_sampling(c.request) for c in sampling])
        sampled = {}
        for chunk, token_id in zip(sampling, token_ids, strict=True):
            request = chunk.request
            matcher = row_sampling(request).matcher
            if (
                matcher is not None
                and token_id not in request.eos_token_ids
                and not matcher.accept_token(token_id)
            ):
                failed[request.id] = RuntimeError(f"Sampled token {token_id} breaks the grammar.")
            else:
                sampled[request.id] = token_id
        return StepResult(sampled, failed)

    def _mask(self, chunk: Chunk) -> torch.Tensor | None:
        """What a chunk's queries may see of its request's tokens: all before
        them (one token, or a whole prompt from its start: the kernel's own
        causal path, as in a plain forward pass), else an explicit mask."""
        n = len(chunk.token_ids)
        if n == 1 or (chunk.start == 0 and self.kernel == "sdpa"):
            return None
        query = torch.arange(chunk.start, chunk.start + n, device=self.device)
        visible = torch.arange(chunk.start + n, device=self.device)[None, :] <= query[:, None]
        if self.kernel == "eager":  # an additive mask
            dtype = self.model.dtype
            hidden = torch.zeros(visible.shape, dtype=dtype, device=self.device)
            return hidden.masked_fill(~visible, torch.finfo(dtype).min)[None, None]
        return visible[None, None]

    @staticmethod
    def _start_matcher(chunk: Chunk, failed: dict[int, BaseException]) -> bool:
        """A grammar matcher, advanced through the tokens generated before, for
        a request's first chunk; False (and ``failed``) when those tokens
        break its grammar."""
        sampling = row_sampling(chunk.request)
        if sampling.grammar is None or sampling.matcher is not None:
            return True
        # The stop tokens are this request's end tokens, so a completed grammar
        # leaves the model nothing but the end of its turn to sample.
        matcher = xgr.GrammarMatcher(
            sampling.grammar, override_stop_tokens=sorted(chunk.request.eos_token_ids)
        )
        for position, token_id in enumerate(sampling.generated_ids):
            if not matcher.accept_token(token_id):
                failed[chunk.request.id] = ValueError(
                    f"Generated token {token_id} at {position} breaks the grammar."
                )
                return False
        sampling.matcher = matcher
        return True

    def _choose(self, logits: torch.Tensor, rows: list[RowSampling]) -> list[int]:
        """The next token of each row: its grammar's mask, then greedy or sampled."""
        # generate() also turns the last position's logits into fp32 before any
        # processing, so bf16/fp16 models pick the same way here.
        logits = logits.to(torch.float32)
        constrained = [
            index
            for index, row in enumerate(rows)
            if row.matcher is not None and row.matcher.fill_next_token_bitmask(self._bitmask, index)
        ]
        if constrained:
            xgr.apply_token_bitmask_inplace(
                logits,
                self._bitmask[: len(rows)].to(logits.device),
                vocab_size=self.vocab_size,
                indices=constrained,
            )
        greedy = logits.argmax(dim=-1)
        temperatures = [row.temperature for row in rows]
        chosen: list[int]
        if all(t <= 0 for t in temperatures):
            chosen = greedy.tolist()
            return chosen
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
        probabilities = torch.softmax(logits / scale.unsqueeze(1), dim=-1)
        sampled = torch.multinomial(probabilities, num_samples=1).squeeze(1)
        is_greedy = torch.tensor([t <= 0 for t in temperatures], device=logits.device)
        chosen = torch.where(is_greedy, greedy, sampled).tolist()
        return chosen
