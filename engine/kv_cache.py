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

Growing must not copy every slot: on the 2-core CPU, a 3,500-token prompt
joining 4 decoding streams grew the slots 5 times as its chunks came, each
time copying all 8 of them into new tensors while every stream waited (288,
697, 2,612, 1,628 and 5,097 ms, against steps of 150-500 ms). So on a CPU
the slots' tensors are views into room reserved when they are made for
``slot_tokens`` tokens a slot (the longest request the engine may hold):
anonymous memory, which the OS gives page by page as tokens are first
written, zeros until then; growing only widens the views. Elsewhere (a GPU
copies fast, and commits what it reserves), or past the reservation, the
tensors are made anew and the tokens copied over.

The price is padding: every slot has the longest request's room. What is
held is counted as it is (``allocated_tokens``). The decoding rows read only
their own tokens of it on a CPU (``decode_attention``); torch's kernel, used
elsewhere, attends over padded slots only while they are at most twice the
tokens they hold (``decoder.Decoding``), and beyond that rows attend one by
one over their own.

A finished request's tokens that the prefix cache keeps are copied out of
its slot into an entry of their own size, a few layers a step
(``COPY_TOKEN_LAYERS``), its slot free once they are all copied: in one
step, the 3,500 tokens of a long prompt cancelled after its first token
stalled the streams decoding beside it for 435 ms (its new memory's page
faults, mostly), in the service on the 2-core CPU. A slot needed while
none is free, a request adopting the entry, or nothing left running
finishes the copy at once. A request that starts with a cached prefix
(``Adopt``), or with what a running request has computed (``Share``), gets
a copy of those tokens in its slot.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from .scheduler import Adopt, MemoryOp, Release, Share

# Capacity is a multiple of this many tokens.
GROW_TOKENS = 256
# Tokens times layers copied into prefix-cache entries per step (at least a
# layer): 2 layers of a 3,500-token prompt, about 11 MB of SmolLM2's keys
# and values in float32.
COPY_TOKEN_LAYERS = 8192


@dataclass(eq=False)
class Entry:
    """A prefix-cache entry's keys and values, all layers."""

    keys: torch.Tensor  # [layers, kv_heads, tokens, head_dim]
    values: torch.Tensor
    slot: int | None = None  # the slot its tokens are still being copied from
    copied: int = 0  # layers copied from it so far


class KVCache:
    """The running requests' slots (``max_slots``: the engine's ``max_batch``),
    on a CPU with room reserved for ``slot_tokens`` tokens each, and the
    prefix cache's entries of one model."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, max_slots: int, slot_tokens: int = 0) -> None:  # fmt: skip
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.slot_tokens = slot_tokens if device.type == "cpu" else 0
        self.holders: list[int | None] = [None] * max_slots  # the request in each slot
        self.slot_of: dict[int, int] = {}
        self.entries: dict[int, Entry] = {}
        self._copying: dict[int, Entry] = {}  # entries still copied from a slot, oldest first
        self.allocated_tokens = 0  # slots times capacity, and the entries' tokens
        self.peak_allocated_tokens = 0
        shape = (layers, max_slots, kv_heads, 0, head_dim)  # capacity 0, then GROW_TOKENS
        self.keys = self.values = torch.empty(shape, dtype=dtype, device=device)
        self._room = (self.keys, self.values)  # what the slots' views are views of
        self._resize(GROW_TOKENS)

    @property
    def capacity(self) -> int:
        return int(self.keys.shape[3])

    def _count(self, change: int) -> None:
        self.allocated_tokens += change
        self.peak_allocated_tokens = max(self.peak_allocated_tokens, self.allocated_tokens)

    def _resize(self, capacity: int) -> None:
        """Every slot with room for ``capacity`` tokens: wider views of the room
        held where it has that many, else new room, the tokens kept copied over
        (when it shrinks, nothing runs: nothing is kept). The rest is zeros, not
        garbage: a padded slot's unused tokens are read (masked out) by the
        decoding rows' attention, and must not be NaN there."""
        slots, old = len(self.holders), self.capacity
        room = int(self._room[0].shape[3])
        if capacity > room or capacity < old:
            kept = min(old, capacity) if capacity > old else 0
            tokens = max(capacity, self.slot_tokens)
            shape = (self.layers, slots, self.kv_heads, tokens, self.head_dim)
            resized = []
            for tensor in (self.keys, self.values):
                new = self._zeros(shape)
                if kept:
                    new[:, :, :, :kept] = tensor[:, :, :, :kept]
                resized.append(new)
            self._room = (resized[0], resized[1])
        self.keys, self.values = (tensor[:, :, :, :capacity] for tensor in self._room)
        self._count(slots * (capacity - old))

    def _zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A tensor of zeros; on a CPU, of anonymous memory, which the OS maps
        page by page as it is first written (or read: its zero page), so that
        room reserved costs nothing until used."""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=self.dtype, device=self.device)
        size = math.prod(shape) * self.dtype.itemsize
        memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(memory, dtype=self.dtype).view(shape)

    def room(self, request_id: int, tokens: int) -> int:
        """The slot of ``request_id`` (claimed on its first call), with room for
        ``tokens`` tokens."""
        slot = self.slot_of.get(request_id)
        if slot is None:
            if None not in self.holders:
                self.copy_entries(None)  # a slot still copied from is needed now
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
                self._copy(op.entry_id, self.layers)
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
            if op.entry_id is not None:  # the slot stays taken until its tokens are copied
                shape = (self.layers, self.kv_heads, op.tokens, self.head_dim)
                keys, values = (torch.empty(shape, dtype=self.dtype, device=self.device)
                                for _ in "kv")  # fmt: skip
                entry = Entry(keys, values, slot=slot)
                self.entries[op.entry_id] = self._copying[op.entry_id] = entry
                self._count(op.tokens)
            else:
                self.holders[slot] = None
            if not self.slot_of and self.capacity > GROW_TOKENS:  # nothing runs
                self.copy_entries(None)
                self._resize(GROW_TOKENS)
        else:
            evicted = self.entries.pop(op.entry_id, None)
            if evicted is not None:
                self._count(-int(evicted.keys.shape[2]))
                if self._copying.pop(op.entry_id, None) is not None:
                    assert evicted.slot is not None
                    self.holders[evicted.slot] = None

    def copy_entries(self, token_layers: int | None = COPY_TOKEN_LAYERS) -> None:
        """Copy finished requests' tokens from their slots into their entries,
        oldest first: about ``token_layers`` tokens times layers (at least a
        layer), or all of them (None); each slot copied whole is free."""
        for entry_id, entry in list(self._copying.items()):
            if token_layers is not None and token_layers <= 0:
                return
            tokens = int(entry.keys.shape[2])
            layers = self.layers - entry.copied
            if token_layers is not None:
                layers = min(layers, max(1, token_layers // tokens))
                token_layers -= layers * tokens
            self._copy(entry_id, entry.copied + layers)

    def _copy(self, entry_id: int, layers: int) -> None:
        """Entry ``entry_id`` copied from its slot up to layer ``layers``
        (excluded); its slot freed once every layer is."""
        entry = self.entries[entry_id]
        if entry.slot is None:
            return
        tokens, begin = int(entry.keys.shape[2]), entry.copied
        entry.keys[begin:layers] = self.keys[begin:layers, entry.slot, :, :tokens]
        entry.values[begin:layers] = self.values[begin:layers, entry.slot, :, :tokens]
        entry.copied = layers
        if layers == self.layers:
            self.holders[entry.slot] = None
            entry.slot = None
            del self._copying[entry_id]
