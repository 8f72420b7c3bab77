"""Continuous batching: one engine thread decodes many generations at once.

Why: a worker that runs one ``model.generate`` at a time leaves most of the
hardware idle; decoding 8 sequences in one forward pass costs little more
than decoding one (about 5x the aggregate tokens/s on the 2-core CPU, far
more on a GPU). A static batch would make a new request wait until the
whole batch drains, so the batch is rebuilt between decoding steps instead
(iteration-level, or continuous, batching, as TGI's pre-flash
``CausalLMBatch`` did): a request joins at the next step and leaves as soon
as it ends.

How a batch is kept (``_Batch``): one row per generation over a
left-padded KV cache (a transformers ``DynamicCache``, ``[rows, heads,
positions, head_dim]`` per layer). Beside it, per row: the token to feed
next, a 0/1 attention mask over the cache positions (0 = left padding) and
the position id of that token, so RoPE sees each row's own positions. New
requests are prefilled (their prompt plus any tokens an earlier attempt
generated; those joining at the same step in one pass, packed end to end
without padding), their first token sampled from that prefill, and their
caches then merged into the running batch, padded on the left to the
longest row (``concatenate``). A finished or cancelled row is dropped at once
(``filter``), and the cache columns that were padding in every remaining
row are cut off.

Per generation the engine keeps its temperature (0 = greedy), token limit,
end-of-sequence ids, an optional xgrammar matcher (one row of a batched
token bitmask per constrained row) and the caller's callback. All model
calls happen on the engine's own thread; callers only submit, cancel and
wait. See ``BatchingEngine`` for the contract.
"""

from __future__ import annotations

import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Literal

import torch
import xgrammar as xgr
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .engine import Sampling
from .loading import LoadedModel

log = logging.getLogger(__name__)

FinishReason = Literal["eos", "length", "stopped", "cancelled", "error"]
TokenCallback = Callable[[int], "bool | None"]

_STREAM_END = object()

# The longest the batch waits for a request submitted with
# ``hold_after_first`` to release it (normally a few milliseconds: the time
# its caller takes to write the first token).
HOLD_SECONDS = 0.05


class Generation:
    """One submitted request, as its caller sees it.

    ``token_ids`` are the tokens this engine generated for it (an end token
    included when the model chose one), ``finish_reason`` is set once it has
    left the engine: ``eos`` (the model ended it), ``length``
    (``max_new_tokens`` reached), ``stopped`` (the callback asked),
    ``cancelled`` (``cancel()`` or the engine closed) or ``error`` (then
    ``error`` holds the exception; only this request is affected).
    """

    def __init__(self, request_id: int, streamed: bool, held: bool = False) -> None:
        self.request_id = request_id
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason | None = None
        self.error: BaseException | None = None
        self.submitted_at = time.monotonic()
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self._cancel_requested = False
        self._finished = threading.Event()
        self._released = threading.Event()
        if not held:
            self._released.set()
        self._stream: queue.SimpleQueue | None = queue.SimpleQueue() if streamed else None

    def cancel(self) -> None:
        """Ask the engine to drop this request; takes effect before its next token.

        Safe from any thread; a no-op once it has finished.
        """
        self._cancel_requested = True

    def release(self) -> None:
        """Let the batch take its next step (see ``submit``'s ``hold_after_first``);
        safe from any thread, and more than once."""
        self._released.set()

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the request has left the engine; False on timeout."""
        return self._finished.wait(timeout)

    def stream(self, timeout: float | None = None) -> Iterator[int]:
        """The tokens one by one as they come (only for requests submitted without
        ``on_token``); ends when the request has finished. ``timeout`` bounds the
        wait for each token (``queue.Empty`` past it)."""
        if self._stream is None:
            raise RuntimeError("This request delivers its tokens to its on_token callback.")
        while True:
            item = self._stream.get(timeout=timeout)
            if item is _STREAM_END:
                return
            yield item

    def tokens(self, poll: float) -> Iterator[int | None]:
        """The tokens as they come (for requests submitted without ``on_token``),
        and None whenever ``poll`` seconds pass without one, so that the caller
        can do its own work between tokens; ends when the request has finished."""
        if self._stream is None:
            raise RuntimeError("This request delivers its tokens to its on_token callback.")
        while True:
            try:
                item = self._stream.get(timeout=poll)
            except queue.Empty:
                yield None
                continue
            if item is _STREAM_END:
                return
            yield item

    # --- called on the engine thread -----------------------------------------------

    def _deliver(self, token_id: int, on_token: TokenCallback | None) -> bool:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.token_ids.append(token_id)
        if on_token is None:
            self._stream.put(token_id)
            return False
        return bool(on_token(token_id))

    def _finish(self, reason: FinishReason, error: BaseException | None = None) -> None:
        if self._finished.is_set():
            return
        self.finish_reason = reason
        self.error = error
        self.finished_at = time.monotonic()
        if self._stream is not None:
            self._stream.put(_STREAM_END)
        self._finished.set()


class _Sequence:
    """What the engine keeps for one generation beside its batch row."""

    def __init__(
        self,
        generation: Generation,
        input_ids: list[int],
        sampling: Sampling,
        eos_token_ids: frozenset[int],
        grammar: xgr.CompiledGrammar | None,
        generated_ids: list[int],
        on_token: TokenCallback | None,
    ) -> None:
        self.generation = generation
        self.input_ids = input_ids  # prompt + tokens generated before (resume)
        self.temperature = sampling.temperature
        self.max_new_tokens = sampling.max_new_tokens
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar
        self.generated_ids = generated_ids
        self.on_token = on_token
        self.matcher: xgr.GrammarMatcher | None = None

    def start_matcher(self) -> None:
        """A grammar matcher advanced through the tokens generated before."""
        if self.grammar is None:
            return
        # The stop tokens are this request's end tokens, so a completed grammar
        # leaves the model nothing but the end of its turn to sample.
        matcher = xgr.GrammarMatcher(self.grammar, override_stop_tokens=sorted(self.eos_token_ids))
        for position, token_id in enumerate(self.generated_ids):
            if not matcher.accept_token(token_id):
                raise ValueError(f"Generated token {token_id} at {position} breaks the grammar.")
        self.matcher = matcher

    def take(self, token_id: int) -> bool:
        """Hand a sampled token to the caller; True when this generation has ended."""
        generation = self.generation
        if generation.cancel_requested:
            generation._finish("cancelled")
            return True
        is_end = token_id in self.eos_token_ids
        try:
            # An end token ends the request anyway, and the solo path never
            # feeds it to its matcher either.
            if self.matcher is not None and not is_end and not self.matcher.accept_token(token_id):
                raise RuntimeError(f"Sampled token {token_id} breaks the grammar.")
            stop = generation._deliver(token_id, self.on_token)
        except Exception as exc:  # the caller's callback: only this request fails
            log.warning(
                "Generation %s failed in its callback", generation.request_id, exc_info=True
            )
            generation._finish("error", exc)
            return True
        if is_end:
            generation._finish("eos")
        elif stop:
            generation._finish("stopped")
        elif len(generation.token_ids) >= self.max_new_tokens:
            generation._finish("length")
        else:
            return False
        return True


class _Batch:
    """Rows decoding together over one left-padded KV cache (the TGI scheme).

    Invariant: ``attention_mask`` has one column per cache position (0 for
    left padding); ``next_ids`` and ``position_ids`` hold, per row, the token
    the next forward pass feeds and its position in that row's own sequence.
    """

    def __init__(
        self,
        sequences: list[_Sequence],
        cache: DynamicCache,
        attention_mask: torch.Tensor,
        next_ids: torch.Tensor,
        position_ids: torch.Tensor,
    ) -> None:
        self.sequences = sequences
        self.cache = cache
        self.attention_mask = attention_mask
        self.next_ids = next_ids
        self.position_ids = position_ids
        self.padded = bool((attention_mask == 0).any())

    def __len__(self) -> int:
        return len(self.sequences)

    @staticmethod
    def concatenate(batches: list[_Batch]) -> _Batch:
        """One batch of all rows, each cache left-padded to the longest."""
        if len(batches) == 1:
            return batches[0]
        width = max(batch.attention_mask.shape[1] for batch in batches)
        rows = sum(len(batch) for batch in batches)
        first = batches[0]
        attention_mask = first.attention_mask.new_zeros((rows, width))
        start = 0
        for batch in batches:
            end = start + len(batch)
            attention_mask[start:end, width - batch.attention_mask.shape[1] :] = (
                batch.attention_mask
            )
            start = end
        for layer_index, layer in enumerate(first.cache.layers):
            for name in ("keys", "values"):
                like = getattr(layer, name)
                merged = like.new_zeros((rows, like.shape[1], width, like.shape[3]))
                start = 0
                for batch in batches:
                    part = getattr(batch.cache.layers[layer_index], name)
                    end = start + len(batch)
                    merged[start:end, :, width - part.shape[2] :] = part
                    start = end
                setattr(layer, name, merged)
        return _Batch(
            [sequence for batch in batches for sequence in batch.sequences],
            first.cache,
            attention_mask,
            torch.cat([batch.next_ids for batch in batches]),
            torch.cat([batch.position_ids for batch in batches]),
        )

    def filter(self, keep: list[int]) -> _Batch | None:
        """The batch of the rows at ``keep`` only, without padding none of them needs."""
        if not keep:
            return None
        if len(keep) == len(self):
            return self
        index = torch.tensor(keep, device=self.attention_mask.device)
        attention_mask = self.attention_mask.index_select(0, index)
        used = attention_mask.any(dim=0).nonzero()
        cut = int(used[0]) if len(used) else attention_mask.shape[1]
        attention_mask = attention_mask[:, cut:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, cut:]
            layer.values = layer.values.index_select(0, index)[:, :, cut:]
        return _Batch(
            [self.sequences[i] for i in keep],
            self.cache,
            attention_mask,
            self.next_ids.index_select(0, index),
            self.position_ids.index_select(0, index),
        )


def _packed_causal_mask(lengths: list[int], device: torch.device) -> torch.Tensor:
    """The 4D boolean sdpa mask of sequences packed end to end in one row: each
    token sees the earlier tokens of its own sequence only."""
    owner = torch.repeat_interleave(
        torch.arange(len(lengths), device=device), torch.tensor(lengths, device=device)
    )
    position = torch.arange(len(owner), device=device)
    mask = (owner[:, None] == owner[None, :]) & (position[:, None] >= position[None, :])
    return mask[None, None]


class BatchingEngine:
    """Runs up to ``max_batch`` generations of one model at once, on one thread.

    ``submit`` queues a request and returns its ``Generation`` at once; the
    request joins the running batch before the next decoding step. For every
    token it samples, the engine calls ``on_token(token_id)`` on the engine
    thread (end tokens included, as ``workers.engine.generate`` does); a
    truthy return ends that request (``stopped``). Without ``on_token`` the
    tokens go to ``Generation.stream()``. Callbacks must be quick: every row
    of the batch waits for them. An exception in one is logged and ends only
    that request (``error``). ``Generation.cancel()`` drops the request
    before its next token. ``close()`` stops the thread and cancels
    whatever is left.
    """

    def __init__(self, lm: LoadedModel, max_batch: int = 8, name: str | None = None) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self.lm = lm
        self.model = lm.model
        self.max_batch = max_batch
        self.vocab_size = lm.model.config.vocab_size
        self.default_eos = frozenset(lm.eos_token_ids)
        self._bitmask = xgr.allocate_token_bitmask(max_batch, self.vocab_size)
        self._ids = itertools.count(1)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._wakeup = threading.Condition()
        self._closing = False
        self._running = 0
        self._thread = threading.Thread(
            target=self._loop, name=name or f"batching-{lm.spec.id}", daemon=True
        )
        self._thread.start()

    # --- the callers' side -----------------------------------------------------------

    def submit(
        self,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        on_token: TokenCallback | None = None,
        *,
        generated_ids: Sequence[int] = (),
        grammar: xgr.CompiledGrammar | None = None,
        eos_token_ids: Iterable[int] | None = None,
        hold_after_first: bool = False,
    ) -> Generation:
        """Queue one generation; thread-safe.

        ``generated_ids`` are tokens an earlier attempt already produced
        (resume): they are fed after the prompt, the grammar's matcher first
        accepts them, and ``sampling.max_new_tokens`` counts only new tokens.
        ``grammar`` (from ``workers.constraints.compiled_grammar``) constrains
        every sampled token. ``eos_token_ids`` default to the model's.

        With ``hold_after_first`` the batch takes no step after this request's
        first token until ``Generation.release()`` (``HOLD_SECONDS`` at most):
        the caller's work on the token a user waits for (writing it, sending
        it) then has the CPU to itself instead of sharing it with the step.
        """
        sequence = _Sequence(
            Generation(next(self._ids), streamed=on_token is None, held=hold_after_first),
            [*prompt_ids, *generated_ids],
            sampling,
            frozenset(eos_token_ids) if eos_token_ids is not None else self.default_eos,
            grammar,
            list(generated_ids),
            on_token,
        )
        if not sequence.input_ids:
            raise ValueError("A generation needs at least one prompt token.")
        with self._wakeup:
            if self._closing:
                raise RuntimeError("The engine is closed.")
            self._waiting.append(sequence)
            self._wakeup.notify()
        return sequence.generation

    @property
    def running(self) -> int:
        """Generations in the batch now (not counting those still waiting)."""
        return self._running

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def closed(self) -> bool:
        return self._closing

    def close(self, timeout: float | None = None) -> None:
        """Stop the engine thread after its current step; unfinished requests end
        as ``cancelled``."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join(timeout)

    # --- the engine thread ------------------------------------------------------------

    def _loop(self) -> None:
        batch: _Batch | None = None
        with torch.inference_mode():
            while True:
                with self._wakeup:
                    while not self._closing and batch is None and not self._waiting:
                        self._wakeup.wait()
                    if self._closing:
                        break
                    room = self.max_batch - (len(batch) if batch else 0)
                    joining = [
                        self._waiting.popleft() for _ in range(min(room, len(self._waiting)))
                    ]
                if batch is not None:
                    batch = self._drop_cancelled(batch)
                parts = [batch] if batch is not None else []
                if joining:
                    joined = self._prefill(joining)
                    self._hold_for(joined)
                    parts += joined
                batch = _Batch.concatenate(parts) if parts else None
                self._running = len(batch) if batch else 0
                if batch is not None:
                    batch = self._decode(batch)
                self._running = len(batch) if batch else 0
            for sequence in [*(batch.sequences if batch else []), *self._waiting]:
                sequence.generation._finish("cancelled")
            self._waiting.clear()
            self._running = 0

    @staticmethod
    def _hold_for(joined: list[_Batch]) -> None:
        """Wait until the callers that hold the batch after their first token
        release it, ``HOLD_SECONDS`` at most."""
        deadline = time.monotonic() + HOLD_SECONDS
        for batch in joined:
            for sequence in batch.sequences:
                sequence.generation._released.wait(max(0.0, deadline - time.monotonic()))

    def _drop_cancelled(self, batch: _Batch) -> _Batch | None:
        keep = []
        for row, sequence in enumerate(batch.sequences):
            if sequence.generation.cancel_requested:
                sequence.generation._finish("cancelled")
            else:
                keep.append(row)
        return batch.filter(keep)

    def _prefill(self, sequences: list[_Sequence]) -> list[_Batch]:
        """One-row batches of the joining sequences after their prompt pass and
        first token, leaving out those already ended (cancelled, failed, done
        after one token).

        Sequences joining together share one forward pass, packed end to end
        in a single row with positions restarting at each one (transformers
        then keeps them apart with a block-diagonal mask): no padding is
        computed, and every weight is read once for all of them.
        """
        ready = []
        for sequence in sequences:
            generation = sequence.generation
            if generation.cancel_requested:
                generation._finish("cancelled")
            elif sequence.max_new_tokens <= 0:
                generation._finish("length")
            else:
                try:
                    sequence.start_matcher()
                except Exception as exc:
                    generation._finish("error", exc)
                else:
                    ready.append(sequence)
        if not ready:
            return []
        if len(ready) > 1 and self.model.config._attn_implementation == "sdpa":
            groups = [ready]
        else:  # other attention kernels take their masks in other forms
            groups = [[sequence] for sequence in ready]
        return [single for group in groups for single in self._prefill_together(group)]

    def _prefill_together(self, ready: list[_Sequence]) -> list[_Batch]:
        device = self.model.device
        lengths = [len(sequence.input_ids) for sequence in ready]
        ends = list(itertools.accumulate(lengths))
        try:
            cache = DynamicCache(config=self.model.config)
            output = self.model(
                input_ids=torch.tensor([[t for s in ready for t in s.input_ids]], device=device),
                attention_mask=_packed_causal_mask(lengths, device) if len(ready) > 1 else None,
                position_ids=torch.cat([torch.arange(n, device=device) for n in lengths])[None],
                cache=cache,
                use_cache=True,
                logits_to_keep=torch.tensor([end - 1 for end in ends], device=device),
            )
            if any(type(layer) is not DynamicLayer for layer in cache.layers):
                raise NotImplementedError(
                    "Batching needs a plain DynamicCache (no sliding window)."
                )
            token_ids = self._choose(output.logits[0], ready)
        except Exception as exc:
            log.exception("Prefill of %d generations failed", len(ready))
            for sequence in ready:
                sequence.generation._finish("error", exc)
            return []
        singles = []
        for sequence, token_id, length, end in zip(ready, token_ids, lengths, ends, strict=True):
            if sequence.take(token_id):
                continue
            if len(ready) == 1:
                own_cache = cache
            else:  # this sequence's own stretch of the packed cache
                own_cache = DynamicCache(
                    ddp_cache_data=[
                        (
                            layer.keys[:, :, end - length : end],
                            layer.values[:, :, end - length : end],
                        )
                        for layer in cache.layers
                    ]
                )
            singles.append(
                _Batch(
                    [sequence],
                    own_cache,
                    torch.ones((1, length), dtype=torch.long, device=device),
                    torch.tensor([[token_id]], device=device),
                    torch.tensor([[length]], device=device),
                )
            )
        return singles

    def _decode(self, batch: _Batch) -> _Batch | None:
        """One decoding step for every row; returns the rows still going."""
        try:
            attention_mask = torch.cat(
                [batch.attention_mask, batch.attention_mask.new_ones((len(batch), 1))], dim=1
            )
            output = self.model(
                input_ids=batch.next_ids,
                # Without padding the mask is all ones: leaving it out lets the
                # attention run its unmasked path, exactly as a lone generate does.
                attention_mask=attention_mask if batch.padded else None,
                position_ids=batch.position_ids,
                cache=batch.cache,
                use_cache=True,
                logits_to_keep=1,
            )
            token_ids = self._choose(output.logits[:, -1, :], batch.sequences)
        except Exception as exc:  # the model itself failed: every row shares that fate
            log.exception("Decoding step failed for %d generations", len(batch))
            for sequence in batch.sequences:
                sequence.generation._finish("error", exc)
            return None
        batch.attention_mask = attention_mask
        batch.position_ids = batch.position_ids + 1
        batch.next_ids = torch.tensor([[t] for t in token_ids], device=batch.next_ids.device)
        keep = [
            row for row, sequence in enumerate(batch.sequences) if not sequence.take(token_ids[row])
        ]
        return batch.filter(keep)

    def _choose(self, logits: torch.Tensor, sequences: list[_Sequence]) -> list[int]:
        """The next token of each row: its grammar's mask, then greedy or sampled."""
        # generate() also turns the last position's logits into fp32 before any
        # processing, so bf16/fp16 models pick the same way here.
        logits = logits.to(torch.float32)
        constrained = [
            row
            for row, sequence in enumerate(sequences)
            if sequence.matcher is not None
            and sequence.matcher.fill_next_token_bitmask(self._bitmask, row)
        ]
        if constrained:
            xgr.apply_token_bitmask_inplace(
                logits,
                self._bitmask[: len(sequences)].to(logits.device),
                vocab_size=self.vocab_size,
                indices=constrained,
            )
        greedy = logits.argmax(dim=-1)
        temperatures = [sequence.temperature for sequence in sequences]
        if all(t <= 0 for t in temperatures):
            return greedy.tolist()
        scale = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
        probabilities = torch.softmax(logits / scale.unsqueeze(1), dim=-1)
        sampled = torch.multinomial(probabilities, num_samples=1).squeeze(1)
        is_greedy = torch.tensor([t <= 0 for t in temperatures], device=logits.device)
        return torch.where(is_greedy, greedy, sampled).tolist()


_engines: dict[str, BatchingEngine] = {}
_engines_lock = threading.Lock()


def engine_for(lm: LoadedModel, max_batch: int = 8) -> BatchingEngine:
    """The process's one engine for a loaded model, started on first use
    (``max_batch`` counts only then)."""
    with _engines_lock:
        running = _engines.get(lm.spec.id)
        if running is None or running.closed:
            running = _engines[lm.spec.id] = BatchingEngine(lm, max_batch=max_batch)
        return running
