"""The running requests' slots (``engine.kv_cache``) as they grow for the
longest request: within the room reserved for them on a CPU, growing moves
and copies nothing (a long prompt joining decoding streams once stalled them
for seconds while every slot was copied); past it, the tokens held are
copied over; once nothing runs, the room goes back to its first size. And
a finished request's tokens kept for the prefix cache are copied out of its
slot a few layers a step (in one step, they stalled the streams beside it),
at once when its entry or its slot is needed. Plain torch, no model."""

from __future__ import annotations

import torch

from engine.kv_cache import GROW_TOKENS, KVCache
from engine.scheduler import Adopt, Evict, Release


def slots(slot_tokens: int) -> KVCache:
    return KVCache(
        2, 2, 4, torch.float32, torch.device("cpu"), max_slots=3, slot_tokens=slot_tokens
    )


def hold(memory: KVCache, request_id: int, tokens: int, value: float) -> int:
    """Request ``request_id``'s slot with ``tokens`` tokens of keys and values written."""
    slot = memory.room(request_id, tokens)
    memory.keys[:, slot, :, :tokens] = value
    memory.values[:, slot, :, :tokens] = -value
    return slot


def holds(memory: KVCache, slot: int, tokens: int, value: float) -> bool:
    """Whether ``slot`` holds ``tokens`` tokens of ``value`` and zeros after them."""
    keys, values = memory.keys[:, slot], memory.values[:, slot]
    return bool(
        (keys[:, :, :tokens] == value).all()
        and (values[:, :, :tokens] == -value).all()
        and not keys[:, :, tokens:].any()
        and not values[:, :, tokens:].any()
    )


def test_slots_grow_within_their_reserved_room_without_moving() -> None:
    memory = slots(slot_tokens=8 * GROW_TOKENS)
    decoding = hold(memory, 1, 40, 1.0)
    keys_at, values_at = memory.keys.data_ptr(), memory.values.data_ptr()
    # a long prompt joins and is computed chunk by chunk: the capacity grows step by step
    for tokens in range(GROW_TOKENS, 5 * GROW_TOKENS, GROW_TOKENS // 2):
        joining = hold(memory, 2, tokens, 2.0)
        assert memory.capacity >= tokens
        assert (memory.keys.data_ptr(), memory.values.data_ptr()) == (keys_at, values_at)
        assert holds(memory, decoding, 40, 1.0) and holds(memory, joining, tokens, 2.0)
    assert memory.allocated_tokens == 3 * memory.capacity


def test_slots_past_their_room_keep_their_tokens() -> None:
    for slot_tokens in (0, GROW_TOKENS):  # nothing reserved (a GPU), or too little
        memory = slots(slot_tokens)
        decoding = hold(memory, 1, 40, 1.0)
        joining = hold(memory, 2, 3 * GROW_TOKENS + 5, 2.0)
        assert memory.capacity >= 3 * GROW_TOKENS + 5
        assert holds(memory, decoding, 40, 1.0)
        assert holds(memory, joining, 3 * GROW_TOKENS + 5, 2.0)


def test_room_goes_back_when_nothing_runs() -> None:
    memory = slots(slot_tokens=8 * GROW_TOKENS)
    hold(memory, 1, 40, 1.0)
    hold(memory, 2, 3 * GROW_TOKENS, 2.0)
    memory.apply(Release(1))
    assert memory.capacity > GROW_TOKENS  # request 2 still runs
    memory.apply(Release(2))
    assert memory.capacity == GROW_TOKENS
    assert memory.allocated_tokens == 3 * GROW_TOKENS
    assert holds(memory, hold(memory, 3, 10, 3.0), 10, 3.0)  # what was held is gone


def copying() -> tuple[KVCache, int]:
    """Slots of 6 layers: request 1 decodes; request 2 ended, its first 900
    tokens kept as entry 5, their copy not begun."""
    memory = KVCache(6, 2, 4, torch.float32, torch.device("cpu"), max_slots=3, slot_tokens=1024)
    hold(memory, 1, 40, 1.0)
    slot = hold(memory, 2, 1000, 2.0)
    memory.apply(Release(2, entry_id=5, tokens=900))
    return memory, slot


def copied(memory: KVCache, entry_id: int, value: float) -> bool:
    entry = memory.entries[entry_id]
    return bool((entry.keys == value).all() and (entry.values == -value).all())


def test_a_kept_prefix_is_copied_a_few_layers_a_step_and_frees_its_slot_after() -> None:
    memory, slot = copying()
    steps = 0
    while memory.holders[slot] is not None:  # still copied from: not free
        memory.copy_entries(2000)  # two layers of 900 tokens a step
        steps += 1
    assert steps == 3
    assert copied(memory, 5, 2.0) and memory.entries[5].keys.shape[2] == 900


def test_an_entry_still_copied_is_finished_before_a_request_adopts_it() -> None:
    memory, _ = copying()
    memory.copy_entries(900)  # one layer of six
    memory.apply(Adopt(3, entry_id=5, tokens=900, room=910))
    assert copied(memory, 5, 2.0)
    assert holds(memory, memory.slot_of[3], 900, 2.0)


def test_a_slot_still_copied_from_is_freed_at_once_when_needed() -> None:
    memory, _ = copying()
    hold(memory, 3, 20, 3.0)
    assert None not in memory.holders
    hold(memory, 4, 20, 4.0)  # request 2's slot, its copy finished first
    assert copied(memory, 5, 2.0)


def test_an_entry_evicted_while_copied_frees_its_slot() -> None:
    memory = KVCache(6, 2, 4, torch.float32, torch.device("cpu"), max_slots=2, slot_tokens=1024)
    hold(memory, 1, 40, 1.0)
    slot = hold(memory, 2, 500, 2.0)
    memory.apply(Release(2, entry_id=5, tokens=500))
    memory.apply(Evict(5))
    assert memory.holders[slot] is None and 5 not in memory.entries
    memory.copy_entries()  # nothing left to copy
