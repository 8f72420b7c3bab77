"""The model runner: executes a scheduler's ``StepPlan`` on the model and
samples the next token of each request that asked for one.

Why a runner of its own: the scheduler (``scheduler``) decides in plain
Python; everything that touches tensors is here and in the forward pass it
calls (``decoder``), so that a faster way to run a step (another memory
layout, compiled kernels, CUDA graphs) is a change to these two alone.

How a step runs: the chunks of the plan (a decoding row's one token, a
prompt's chunk) are packed end to end into one sequence and go through the
model in one forward pass, so every weight is read once per step whatever
the mix, and no padding is computed. Attention is the one part that must
tell the requests apart: each chunk is a ``decoder.Row``, its slice of the
sequence and views of its request's memory (``KVStore``), where its keys
and values are stored and over which its queries attend.

Each request's keys and values live in one tensor pair of its own
(``[layers, kv_heads, capacity, head_dim]``), grown ``GROW_TOKENS`` at a
time: a row's attention reads a slice of it, never a gathered copy. A
finished request's memory becomes a prefix-cache entry as it is (no copy);
a request that starts with a cached prefix, or with what a running request
has computed, gets a copy of that prefix.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from .decoder import Decoder, Row
from .scheduler import Adopt, Chunk, MemoryOp, Release, Request, Share, StepPlan

log = logging.getLogger(__name__)

# Memory is grown this many tokens at a time: a generation of n tokens is
# copied n / GROW_TOKENS times, and holds at most this many tokens unused.
GROW_TOKENS = 256


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


def _row(kv: KV, start: int, begin: int, end: int, mask: torch.Tensor | None) -> Row:
    """A chunk's ``Row``: positions ``start`` on of its request's memory ``kv``,
    at ``begin:end`` of the step's sequence."""
    stop = start + end - begin
    return Row(
        begin,
        end,
        mask,
        kv.keys[:, :, start:stop],
        kv.values[:, :, start:stop],
        kv.keys[:, None, :, :stop],
        kv.values[:, None, :, :stop],
    )


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

    def __init__(self, decoder: Decoder, max_batch: int) -> None:
        self.decoder = decoder
        self.device = decoder.device
        self.vocab_size = decoder.vocab_size
        self.store = KVStore(
            decoder.num_layers, decoder.kv_heads, decoder.head_dim, decoder.dtype, self.device
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
        rows: list[Row] = []
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for chunk in chunks:
            begin = len(ids)
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + len(chunk.token_ids))
            stop = chunk.start + len(chunk.token_ids)
            kv = self.store.room(chunk.request.id, stop, chunk.start)
            rows.append(_row(kv, chunk.start, begin, len(ids), self._mask(chunk)))
            if chunk.sample:
                last.append(len(ids) - 1)
        device = self.device
        logits = self.decoder.forward(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            rows,
            torch.tensor(last, dtype=torch.long, device=device),
        )
        if not sampling:
            return StepResult({}, failed)
        token_ids = self._choose(logits, [row_sampling(c.request) for c in sampling])
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
        kernel = self.decoder.kernel
        if n == 1 or (chunk.start == 0 and kernel == "sdpa"):
            return None
        query = torch.arange(chunk.start, chunk.start + n, device=self.device)
        visible = torch.arange(chunk.start + n, device=self.device)[None, :] <= query[:, None]
        if kernel == "eager":  # an additive mask
            dtype = self.decoder.dtype
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
