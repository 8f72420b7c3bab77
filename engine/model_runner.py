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
tell the requests apart: each request holds a slot of the keys and values
(``kv_cache``), the rows of one token attend together over their slots
(``decoder.Decoding``) and a prompt's chunk over its own (``decoder.Span``).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from .decoder import Decoder, Decoding, Span, StepMemory
from .kv_cache import KVCache
from .scheduler import Chunk, MemoryOp, StepPlan

log = logging.getLogger(__name__)


@dataclass
class RowSampling:
    """How one request picks its tokens, and its grammar's matcher: the
    runner's own state of a request, kept by its id (``ModelRunner.add``)."""

    temperature: float  # 0: greedy
    grammar: xgr.CompiledGrammar | None = None
    generated_ids: Sequence[int] = ()  # tokens of earlier attempts, for the matcher
    eos_token_ids: Collection[int] = ()  # the grammar's stop tokens
    matcher: xgr.GrammarMatcher | None = field(default=None, repr=False)


@dataclass
class StepResult:
    sampled: dict[int, int]  # request id -> token id
    failed: dict[int, BaseException]  # requests that failed alone (their grammar)


class ModelRunner:
    """Runs plans on one loaded model, holding ``max_batch`` requests of up to
    ``slot_tokens`` tokens without copying their keys and values as they grow
    (``kv_cache``; 0: each growth copies them)."""

    def __init__(self, decoder: Decoder, max_batch: int, slot_tokens: int = 0) -> None:
        self.decoder = decoder
        self.device = decoder.device
        self.vocab_size = decoder.vocab_size
        self.memory = KVCache(
            decoder.num_layers,
            decoder.kv_heads,
            decoder.head_dim,
            decoder.dtype,
            self.device,
            max_slots=max_batch,
            slot_tokens=slot_tokens,
        )
        self._bitmask = xgr.allocate_token_bitmask(max_batch, self.vocab_size)
        self._rows: dict[int, RowSampling] = {}  # by request id, from add to remove

    def add(self, request_id: int, sampling: RowSampling) -> None:
        """How request ``request_id`` samples, until ``remove``."""
        self._rows[request_id] = sampling

    def remove(self, request_id: int) -> None:
        """Request ``request_id`` has ended: drop its sampling state (its
        memory goes by the scheduler's ``Release``)."""
        self._rows.pop(request_id, None)

    def apply(self, memory_ops: list[MemoryOp]) -> None:
        """Move memory as the scheduler decided: copy cached or running
        prefixes, keep or free what ended requests held, evict cache entries."""
        for op in memory_ops:
            self.memory.apply(op)

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan's memory operations, compute its chunks, and sample
        for the chunks that end their request's input."""
        self.apply(plan.memory_ops)
        self.memory.copy_entries()
        failed: dict[int, BaseException] = {}
        chunks = [chunk for chunk in plan.chunks if self._start_matcher(chunk, failed)]
        if not chunks:
            return StepResult({}, failed)
        # The rows of one token first: they attend together (``Decoding``).
        chunks.sort(key=lambda chunk: len(chunk.token_ids) > 1)
        sampling = [chunk for chunk in chunks if chunk.sample]
        ids: list[int] = []
        positions: list[int] = []
        last: list[int] = []
        for chunk in chunks:
            ids += chunk.token_ids
            positions += range(chunk.start, chunk.start + len(chunk.token_ids))
            if chunk.sample:
                last.append(len(ids) - 1)
        device = self.device
        logits = self.decoder.forward(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            self._memory(chunks),
            torch.tensor(last, dtype=torch.long, device=device),
        )
        if not sampling:
            return StepResult({}, failed)
        rows = [self._rows[chunk.request_id] for chunk in sampling]
        token_ids = self._choose(logits, rows)
        sampled = {}
        for chunk, row, token_id in zip(sampling, rows, token_ids, strict=True):
            matcher = row.matcher
            if (
                matcher is not None
                and token_id not in row.eos_token_ids
                and not matcher.accept_token(token_id)
            ):
                failed[chunk.request_id] = RuntimeError(
                    f"Sampled token {token_id} breaks the grammar."
                )
            else:
                sampled[chunk.request_id] = token_id
        return StepResult(sampled, failed)

    def _memory(self, chunks: list[Chunk]) -> StepMemory:
        """Each chunk's slot, with room for its tokens, and how the step's rows
        attend: the rows of one token together (under the ``sdpa`` kernel;
        where it pads the slots to the longest, while they hold at most twice
        the rows' tokens), every other chunk alone."""
        memory = self.memory
        slots = [memory.room(c.request_id, c.start + len(c.token_ids)) for c in chunks]
        single = 0
        if self.decoder.kernel == "sdpa":
            single = next((i for i, c in enumerate(chunks) if len(c.token_ids) > 1), len(chunks))
        decoding = None
        if single:
            lengths = [c.start + 1 for c in chunks[:single]]
            slot_count, length = max(slots[:single]) + 1, max(lengths)
            if self.decoder.attends_by_length or slot_count * length <= 2 * sum(lengths):
                decoding = self._decoding(slots[:single], lengths, slot_count, length)
            else:
                single = 0
        spans, begin = [], single
        for chunk, slot in zip(chunks[single:], slots[single:], strict=True):
            end = begin + len(chunk.token_ids)
            spans.append(Span(begin, end, slot, chunk.start, self._mask(chunk)))
            begin = end
        return StepMemory(memory.keys, memory.values, decoding, spans)

    def _decoding(self, slots: list[int], lengths: list[int], slot_count: int,
                  length: int) -> Decoding:  # fmt: skip
        device = self.device
        in_order = slots == list(range(slot_count))
        mask = None
        padded = not self.decoder.attends_by_length
        if padded and (not in_order or min(lengths) < length):
            seen = torch.ones(slot_count, dtype=torch.long, device=device)
            seen[slots] = torch.tensor(lengths, device=device)
            visible = torch.arange(length, device=device)[None, :] < seen[:, None]
            mask = visible[:, None, None, :]
        return Decoding(
            rows=len(slots),
            slots=torch.tensor(slots, device=device),
            positions=torch.tensor([n - 1 for n in lengths], device=device),
            lengths=torch.tensor(lengths, device=device),
            slot_count=slot_count,
            length=length,
            mask=mask,
            in_order=in_order,
        )

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

    def _start_matcher(self, chunk: Chunk, failed: dict[int, BaseException]) -> bool:
        """A grammar matcher, advanced through the tokens generated before, for
        a request's first chunk; False (and ``failed``) when those tokens
        break its grammar."""
        sampling = self._rows[chunk.request_id]
        if sampling.grammar is None or sampling.matcher is not None:
            return True
        # The stop tokens are this request's end tokens, so a completed grammar
        # leaves the model nothing but the end of its turn to sample.
        matcher = xgr.GrammarMatcher(
            sampling.grammar, override_stop_tokens=sorted(sampling.eos_token_ids)
        )
        for position, token_id in enumerate(sampling.generated_ids):
            if not matcher.accept_token(token_id):
                failed[chunk.request_id] = ValueError(
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
