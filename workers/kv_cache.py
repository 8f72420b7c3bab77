"""Where the keys and values live: the running requests' in slots of one
tensor pair, the prefix cache's entries each in a pair of its own.

Why slots: the decoding rows of a step attend together, one attention call
per layer over ``keys[layer][:slots, :, :length]``, instead of one call per
row and layer; on the 2-core CPU, 8 rows decoding at context 100-200 took
4-8 ms less a step that way (bench/README.md, issue 26), the calls' own
overhead and the Python around them being most of what attention cost.
A slot is a request's for as long as it runs. The engine's ``max_batch``
slots are made when it starts (on this VM, making 8 of them at a step took
190-290 ms, every stream waiting), ``capacity`` (the tokens every slot has
room for) grows for the longest running request, by half of itself at
least, and goes back to ``GROW_TOKENS`` when nothing runs.

The price is padding: every slot has the longest request's room. What is
held is counted as it is (``allocated_tokens``). The decoding rows read only
their own tokens of it on a CPU (``decode_attention``); torch's kernel, used
elsewhere, attends over padded slots only while they are at most twice the
tokens they hold (``decoder.Decoding``), and beyond that rows attend one by
one over their own.

A finished request's tokens that the prefix cache keeps are copied out of
its slot into an entry of their own size; a request that starts with a
cached prefix (``Adopt``), or with what a running request has computed
(``Share``), gets a copy of those tokens in its slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scheduler import Adopt, MemoryOp, Release, Share

# Capacity is a multiple of this many tokens.
GROW_TOKENS = 256


@dataclass(eq=False)
class Entry:
    """A prefix-cache entry's keys and values, all layers."""

    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    values: torch.Tensor


class KVCache:
    """The running requests' slots (``max_slots``: the engine's ``max_batch``)
    and the prefix cache's entries of one model."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_slots: int) -> None:  # fmt: skip
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.holders: list[int | None] = [None] * max_slots  # the request in each slot
        self.slot_of: dict[int, int] = {}
        self.entries: dict[int, Entry] = {}
        self.allocated_tokens = 0  # slots times capacity, and the entries' tokens
        self.peak_allocated_tokens = 0
        shape = (layers, max_slots, kv_heads, 0, head_dim)  # capacity 0, then GROW_TOKENS
        self.keys = self.values = torch.empty(shape, dtype=dtype, device=device)
        self._resize(GROW_TOKENS)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def _count(self, change: int) -> None:
        self.allocated_tokens += change
        self.peak_allocated_tokens = max(self.peak_allocated_tokens, self.allocated_tokens)

    def _resize(self, capacity: int) -> None:
        """Every slot with room for ``capacity`` tokens, the tokens kept copied
        over. The rest is zeros, not garbage: a padded slot's unused tokens
        are read (masked out) by the decoding rows' attention, and must not
        be NaN there."""
        slots, old = len(self.holders), self.capacity
        shape = (self.layers, slots, self.kv_heads, capacity, self.head_dim)
        kept = min(old, capacity)
        resized = []
        for tensor in (self.keys, self.values):
            new = torch.empty(shape, dtype=self.dtype, device=self.device)
            if kept:
                new[:, :, :, :kept] = tensor[:, :, :, :kept]
            new[:, :, :, kept:] = 0
            resized.append(new)
        self.keys, self.values = resized
        self._count(slots * (capacity - old))

    def room(self, request_id: int, tokens: int) -> int:
        """The slot of ``request_id`` (claimed on its first call), with room for
        ``tokens`` tokens."""
        slot = self.slot_of.get(request_id)
        if slot is None:
            if None not in self.holders:
                raise RuntimeError(f"No slot is free for request {request_id}.")
            slot = self.holders.index(None)
            self.holders[slot] = request_id
            self.slot_of[request_id] = slot
        if tokens > self.capacity:
            grown = max(tokens, self.capacity + max(GROW_TOKENS, self.capacity // 2))
            self._resize(-(-grown // GROW_TOKENS) * GROW_TOKENS)
        return slot

    def apply(self, op: MemoryOp) -> None:
        """Move memory as the scheduler decided (``scheduler.MemoryOp``)."""
        if isinstance(op, Adopt | Share):
            slot = self.room(op.request_id, op.room)
            if isinstance(op, Adopt):
                entry = self.entries[op.entry_id]
                keys, values = entry.keys[:, :, : op.tokens], entry.values[:, :, : op.tokens]
            else:
                source = self.slot_of[op.source_id]
                keys = self.keys[:, source, :, : op.tokens]
                values = self.values[:, source, :, : op.tokens]
            self.keys[:, slot, :, : op.tokens] = keys
            self.values[:, slot, :, : op.tokens] = values
        elif isinstance(op, Release):
            if op.request_id not in self.slot_of:  # it ended before any token was computed
                return
            slot = self.slot_of.pop(op.request_id)
            if op.entry_id is not None:
                self.entries[op.entry_id] = Entry(
                    self.keys[:, slot, :, : op.tokens].clone(),
                    self.values[:, slot, :, : op.tokens].clone(),
                )
                self._count(op.tokens)
            self.holders[slot] = None
            if not self.slot_of and self.capacity > GROW_TOKENS:  # nothing runs
                self._resize(GROW_TOKENS)
        else:
            evicted = self.entries.pop(op.entry_id, None)
            if evicted is not None:
                self._count(-int(evicted.keys.shape[2]))
