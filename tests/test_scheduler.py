"""The scheduler's rules without a model: hand-built step outputs stand for
the model runner's (``engine.scheduler``, plain Python)."""

from __future__ import annotations

import itertools

import pytest

from engine.request import Request, RequestStatus
from engine.scheduler import (
    Adopt,
    BudgetExceededError,
    Evict,
    PrefixCache,
    Release,
    Scheduler,
    Share,
    StepPlan,
)

END = 0  # the end token of every request here
_ids = itertools.count(1)


def request(prompt: int | list[int], max_new: int = 10, priority: int = 0) -> Request:
    prompt_ids = list(range(100, 100 + prompt)) if isinstance(prompt, int) else prompt
    return Request(next(_ids), prompt_ids, max_new, frozenset({END}), priority)


def step(scheduler: Scheduler, token: int = 7, ending: set[int] = frozenset()) -> StepPlan:
    """Plan a step and feed back what a model would sample: ``token`` for every
    chunk that asks for one, the end token for the requests in ``ending``."""
    plan = scheduler.schedule()
    sampled = {
        chunk.request_id: END if chunk.request_id in ending else token
        for chunk in plan.chunks
        if chunk.sample
    }
    scheduler.update(plan, sampled)
    return plan


def fed(plan: StepPlan) -> dict[int, int]:
    return {chunk.request_id: len(chunk.token_ids) for chunk in plan.chunks}


# --- admission under the budget ------------------------------------------------------


def test_requests_are_admitted_while_their_prompts_fit_in_the_budget():
    scheduler = Scheduler(max_batch=8, token_budget=100, chunk_tokens=1000, prefix_cache=False)
    a, b, c = request(40), request(40), request(40)
    for r in (a, b, c):
        scheduler.add(r)
    plan = step(scheduler)
    assert fed(plan) == {a.id: 40, b.id: 40}  # the third would make 120
    assert c.status == RequestStatus.WAITING
    assert scheduler.held_tokens == 82  # two prompts and their first tokens


def test_max_batch_still_bounds_the_rows():
    scheduler = Scheduler(max_batch=2, token_budget=10_000, chunk_tokens=1000, prefix_cache=False)
    requests = [request(5) for _ in range(3)]
    for r in requests:
        scheduler.add(r)
    assert len(step(scheduler).chunks) == 2
    assert requests[2].status == RequestStatus.WAITING


def test_waiting_requests_are_admitted_by_priority_then_arrival_and_in_order():
    scheduler = Scheduler(max_batch=8, token_budget=100, chunk_tokens=1000, prefix_cache=False)
    late, big, small = request(10, priority=5), request(95, priority=1), request(10, priority=1)
    for r in (late, big, small):
        scheduler.add(r)
    assert [r.id for r in scheduler.waiting] == [big.id, small.id, late.id]
    running = request(20)
    scheduler.running.append(running)  # holds 20: the big one must wait
    running.status = RequestStatus.DECODING
    running.output_ids = [7]
    running.num_computed = 20
    plan = scheduler.schedule()
    # the large request at the head is not passed by the smaller ones behind it
    assert fed(plan) == {running.id: 1}
    assert big.status == small.status == late.status == RequestStatus.WAITING


def test_a_prompt_larger_than_the_whole_budget_fails_at_once():
    scheduler = Scheduler(max_batch=8, token_budget=50, chunk_tokens=1000, prefix_cache=False)
    huge, fits = request(60), request(10)
    scheduler.add(huge)
    scheduler.add(fits)
    plan = step(scheduler)
    assert plan.ended == [huge.id]
    assert huge.status == RequestStatus.FAILED and isinstance(huge.error, BudgetExceededError)
    assert fed(plan) == {fits.id: 10}


# --- chunking --------------------------------------------------------------------------


def test_a_long_prompt_is_computed_in_chunks_beside_the_decoding_rows():
    scheduler = Scheduler(max_batch=8, token_budget=10_000, chunk_tokens=64, prefix_cache=False)
    decoding = [request(5, max_new=100) for _ in range(4)]
    for r in decoding:
        scheduler.add(r)
    step(scheduler)
    assert all(r.status == RequestStatus.DECODING for r in decoding)
    long = request(150, max_new=5)
    scheduler.add(long)
    fed_long = []
    while long.status == RequestStatus.WAITING or long.status == RequestStatus.PREFILLING:
        plan = step(scheduler)
        sizes = fed(plan)
        # every decoding row gets its token at every step, the prompt at most a chunk
        assert all(sizes[r.id] == 1 for r in decoding)
        fed_long.append(sizes[long.id])
        assert sum(sizes.values()) <= 64 + len(decoding)
    assert fed_long == [64, 64, 22]
    assert long.status == RequestStatus.DECODING and long.num_computed == 150
    assert long.output_ids == [7]  # sampled once, after its last chunk
    assert scheduler.stats.prompt_tokens_computed == 4 * 5 + 150


def test_chunks_of_a_step_share_its_prompt_tokens_in_admission_order():
    scheduler = Scheduler(max_batch=8, token_budget=10_000, chunk_tokens=50, prefix_cache=False)
    decoding = request(5, max_new=100)
    scheduler.add(decoding)
    step(scheduler)
    a, b = request(30), request(40)
    scheduler.add(a)
    scheduler.add(b)
    plan = step(scheduler)
    assert [(c.request_id, c.start, len(c.token_ids), c.sample) for c in plan.chunks] == [
        (decoding.id, 5, 1, True),
        (a.id, 0, 30, True),
        (b.id, 0, 20, False),
    ]
    plan = step(scheduler)
    assert [(c.request_id, c.start, len(c.token_ids), c.sample) for c in plan.chunks] == [
        (decoding.id, 6, 1, True),
        (a.id, 30, 1, True),
        (b.id, 20, 20, True),
    ]


def test_prompts_with_no_row_decoding_beside_them_are_computed_whole():
    """Chunks only protect decoding rows: alone, a prompt would read every
    weight once per chunk instead of once."""
    scheduler = Scheduler(max_batch=8, token_budget=10_000, chunk_tokens=16, prefix_cache=False)
    a, b = request(100), request(40)
    scheduler.add(a)
    scheduler.add(b)
    assert fed(step(scheduler)) == {a.id: 100, b.id: 40}
    assert a.status == b.status == RequestStatus.DECODING


# --- growth, preemption and re-admission ---------------------------------------------------


def test_a_running_request_without_room_preempts_the_request_admitted_last():
    scheduler = Scheduler(max_batch=8, token_budget=50, chunk_tokens=1000, prefix_cache=False)
    first, second = request(20, max_new=40), request(20, max_new=40)
    scheduler.add(first)
    scheduler.add(second)
    step(scheduler)  # both admitted: 20 + 1 each
    held = []
    while second.status == RequestStatus.DECODING:
        plan = scheduler.schedule()
        held.append(scheduler.held_tokens)  # what the planned step computes into
        scheduler.update(plan, {chunk.request_id: 7 for chunk in plan.chunks})
    assert plan.ended == [second.id] and second.status == RequestStatus.PREEMPTED
    assert Release(second.id) in plan.memory_ops
    assert scheduler.stats.preemptions == 1
    assert max(held) == 50 == scheduler.stats.peak_held_tokens
    assert first.status == RequestStatus.DECODING


def test_a_preempted_request_resumed_later_is_admitted_once_memory_frees():
    scheduler = Scheduler(max_batch=8, token_budget=60, chunk_tokens=1000, prefix_cache=False)
    first = request(20, max_new=30)
    second = request(20, max_new=30)
    scheduler.add(first)
    scheduler.add(second)
    while second.status != RequestStatus.PREEMPTED:
        step(scheduler)
    # its caller resumes it: its prompt and what it generated, the rest to come
    resumed = request([*second.prompt_ids, *second.output_ids], max_new=30 - len(second.output_ids))
    scheduler.add(resumed)
    admitted_while_first_ran = False
    for _ in range(100):
        plan = scheduler.schedule()
        assert scheduler.held_tokens <= 60
        scheduler.update(plan, {chunk.request_id: 7 for chunk in plan.chunks if chunk.sample})
        if resumed.status != RequestStatus.WAITING and first.status == RequestStatus.DECODING:
            admitted_while_first_ran = True
        if resumed.status.finished:
            break
    assert first.status == RequestStatus.FINISHED_LENGTH
    assert resumed.status == RequestStatus.FINISHED_LENGTH
    assert not admitted_while_first_ran  # both together do not fit


def test_a_lone_request_that_outgrows_the_budget_fails_rather_than_loops():
    scheduler = Scheduler(max_batch=8, token_budget=25, chunk_tokens=1000, prefix_cache=False)
    alone = request(20, max_new=100)
    scheduler.add(alone)
    for _ in range(10):
        plan = step(scheduler)
        if alone.status.finished:
            break
    assert alone.status == RequestStatus.FAILED and isinstance(alone.error, BudgetExceededError)
    assert plan.ended == [alone.id]


# --- cancels -----------------------------------------------------------------------------


def test_cancel_while_waiting_holds_nothing_and_frees_nothing():
    scheduler = Scheduler(max_batch=1, token_budget=1000, chunk_tokens=1000, prefix_cache=False)
    running, waiting = request(5), request(5)
    scheduler.add(running)
    scheduler.add(waiting)
    step(scheduler)
    scheduler.abort(waiting, RequestStatus.CANCELLED)
    assert waiting.status == RequestStatus.CANCELLED and scheduler.waiting == []
    plan = step(scheduler)
    assert plan.memory_ops == [] and fed(plan) == {running.id: 1}


def test_cancel_while_prefilling_releases_its_memory_before_the_next_step():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=10, prefix_cache=False)
    decoding = request(5, max_new=100)
    scheduler.add(decoding)
    step(scheduler)
    long = request(40)
    scheduler.add(long)
    step(scheduler)
    assert long.status == RequestStatus.PREFILLING and long.num_computed == 10
    scheduler.abort(long, RequestStatus.CANCELLED)
    assert long.status == RequestStatus.CANCELLED and scheduler.held_tokens == 7
    plan = step(scheduler)
    assert plan.memory_ops == [Release(long.id)] and fed(plan) == {decoding.id: 1}


def test_cancel_while_decoding_drops_the_row_from_the_next_step():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000, prefix_cache=False)
    stays, goes = request(5), request(5)
    scheduler.add(stays)
    scheduler.add(goes)
    step(scheduler)
    scheduler.abort(goes, RequestStatus.CANCELLED)
    plan = step(scheduler)
    assert fed(plan) == {stays.id: 1}
    assert plan.memory_ops == [Release(goes.id)]
    scheduler.abort(goes, RequestStatus.FAILED)  # once finished, a no-op
    assert goes.status == RequestStatus.CANCELLED


# --- ends ------------------------------------------------------------------------------------


def test_requests_end_at_their_end_token_or_their_limit():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000, prefix_cache=False)
    ends, limited = request(5, max_new=10), request(5, max_new=3)
    scheduler.add(ends)
    scheduler.add(limited)
    step(scheduler)
    step(scheduler, ending={ends.id})
    assert ends.status == RequestStatus.FINISHED_EOS and ends.output_ids == [7, END]
    step(scheduler)
    assert limited.status == RequestStatus.FINISHED_LENGTH and limited.output_ids == [7, 7, 7]
    assert not scheduler.has_work


def test_a_request_failed_by_the_runner_ends_alone():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000, prefix_cache=True)
    broken, healthy = request(20), request(20)
    scheduler.add(broken)
    scheduler.add(healthy)
    plan = scheduler.schedule()
    error = ValueError("breaks the grammar")
    changed = scheduler.update(plan, {healthy.id: 7}, {broken.id: error})
    assert changed == [broken, healthy]
    assert broken.status == RequestStatus.FAILED and broken.error is error
    assert healthy.status == RequestStatus.DECODING
    # a failed request's memory is never kept for reuse
    assert scheduler.schedule().memory_ops == [Release(broken.id)]


# --- the prefix cache --------------------------------------------------------------------------


def test_a_finished_request_is_kept_and_a_prompt_starting_with_it_reuses_it():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    first = request(40, max_new=3)
    scheduler.add(first)
    while not first.status.finished:
        step(scheduler)
    computed = first.token_ids()[: first.num_computed]
    assert len(computed) == 42  # the prompt and the two tokens fed back
    plan = scheduler.schedule()
    assert [type(op) for op in plan.memory_ops] == [Release]
    (release,) = plan.memory_ops
    assert release.tokens == 42 and release.entry_id is not None
    follow_up = request([*computed, 7, 1, 2, 3])  # the next turn of the conversation
    scheduler.add(follow_up)
    plan = step(scheduler)
    assert plan.memory_ops == [Adopt(follow_up.id, release.entry_id, 42, 46)]
    assert fed(plan) == {follow_up.id: 4} and plan.chunks[0].start == 42
    assert follow_up.cached_tokens == 42
    assert scheduler.stats.prefix_hits == 1 and scheduler.stats.prefix_tokens_reused == 42
    # the follow-up's own entry covers the first one, which goes
    while not follow_up.status.finished:
        step(scheduler)
    plan = scheduler.schedule()
    assert isinstance(plan.memory_ops[0], Release) and plan.memory_ops[1:] == [
        Evict(release.entry_id)
    ]
    assert len(scheduler.cache) == 1


def test_a_shared_system_prompt_is_reused_token_by_token_past_the_last_block():
    cache = PrefixCache()
    system = list(range(1, 38))  # two whole blocks and 5 tokens
    entry_id, covered = cache.insert([*system, 500, 501])
    assert covered == []
    assert cache.lookup([*system, 600, 601, 602], limit=100) == (entry_id, 37)
    assert cache.lookup([*system[:20], 999], limit=100) == (entry_id, 20)
    assert cache.lookup(system[:10], limit=100) is None  # under a block: not worth a copy
    assert cache.lookup([*system, 500, 501], limit=30) == (entry_id, 30)


def test_a_prompt_always_computes_its_last_token():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    first = request(32, max_new=1)
    scheduler.add(first)
    step(scheduler)
    same = request(list(first.prompt_ids))
    scheduler.add(same)
    plan = step(scheduler)
    assert fed(plan) == {same.id: 1} and same.cached_tokens == 31


def test_a_request_arriving_while_another_with_its_start_runs_copies_what_that_one_computed():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    first = request(40, max_new=10)
    scheduler.add(first)
    step(scheduler)
    step(scheduler)
    assert first.num_computed == 41  # its prompt and its first token
    resumed = request([*first.token_ids()[:41], 7, 7])  # as far as first, then on
    other = request([*first.prompt_ids[:20], 1, 2, 3])  # the same system prompt, then another
    scheduler.add(resumed)
    scheduler.add(other)
    plan = step(scheduler)
    assert plan.memory_ops == [
        Share(resumed.id, first.id, 41, 43),
        Share(other.id, first.id, 20, 23),
    ]
    assert fed(plan) == {first.id: 1, resumed.id: 2, other.id: 3}
    assert (resumed.cached_tokens, other.cached_tokens) == (41, 20)
    assert scheduler.stats.prefix_hits == 2 and scheduler.stats.prefix_tokens_reused == 61
    assert scheduler.stats.prompt_tokens_computed == 40 + 2 + 3


def test_requests_admitted_together_each_compute_their_start():
    """Nothing is computed yet to share: neither waits for the other."""
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    first, same = request(40), request(40)
    scheduler.add(first)
    scheduler.add(same)
    plan = step(scheduler)
    assert plan.memory_ops == [] and fed(plan) == {first.id: 40, same.id: 40}


def test_a_running_request_is_shared_only_where_it_computed_more_than_an_entry_holds():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    done = request(40, max_new=1)
    scheduler.add(done)
    step(scheduler)  # ends at its limit: its 40 tokens become an entry
    running = request([*done.prompt_ids[:30], 5, 5, 5], max_new=10)
    scheduler.add(running)
    plan = step(scheduler)
    (release, adopt) = plan.memory_ops
    assert isinstance(release, Release) and adopt == Adopt(running.id, release.entry_id, 30, 33)
    longer = request([*done.prompt_ids, 9])
    scheduler.add(longer)
    plan = step(scheduler)
    assert plan.memory_ops == [Adopt(longer.id, release.entry_id, 40, 41)]  # the entry holds more


def test_without_a_cache_nothing_running_is_shared():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000, prefix_cache=False)
    first = request(40)
    scheduler.add(first)
    step(scheduler)
    same = request(list(first.prompt_ids))
    scheduler.add(same)
    plan = step(scheduler)
    assert plan.memory_ops == [] and fed(plan) == {first.id: 1, same.id: 40}


def test_cache_entries_are_evicted_least_recently_used_first_to_admit_a_request():
    scheduler = Scheduler(max_batch=8, token_budget=100, chunk_tokens=1000)
    old, new = request(list(range(1, 33)), max_new=1), request(list(range(200, 232)), max_new=1)
    for r in (old, new):
        scheduler.add(r)
        step(scheduler)
    assert len(scheduler.cache) == 2 and scheduler.held_tokens == 64
    big = request(60)
    scheduler.add(big)
    plan = step(scheduler)
    releases = [op for op in plan.memory_ops if isinstance(op, Release)]
    evicted = [op for op in plan.memory_ops if isinstance(op, Evict)]
    assert len(releases) == 1 and len(evicted) == 1  # the older entry only
    assert scheduler.cache.lookup(new.prompt_ids, 100) is not None
    assert scheduler.cache.lookup(old.prompt_ids, 100) is None
    assert fed(plan) == {big.id: 60}
    assert scheduler.held_tokens <= 100


def test_the_entry_a_request_reuses_is_not_evicted_to_admit_it():
    scheduler = Scheduler(max_batch=8, token_budget=100, chunk_tokens=1000)
    system = list(range(1, 49))
    first = request(system, max_new=1)
    scheduler.add(first)
    step(scheduler)  # the entry holds 48 tokens
    follow_up = request([*system, 5, 6])  # needs 50 beside the entry's 48
    scheduler.add(follow_up)
    plan = step(scheduler)
    assert any(isinstance(op, Adopt) for op in plan.memory_ops)
    assert not any(isinstance(op, Evict) for op in plan.memory_ops)
    assert fed(plan) == {follow_up.id: 2}


def test_a_request_whose_cached_prefix_leaves_it_no_room_is_computed_whole():
    """Keeping the entry it would copy would leave the request no room, and
    nothing runs to free any: the entry goes and the prompt is computed whole
    (waiting would wait forever)."""
    scheduler = Scheduler(max_batch=8, token_budget=60, chunk_tokens=1000)
    system = list(range(1, 33))
    first = request([*system, *range(900, 910)], max_new=1)
    scheduler.add(first)
    step(scheduler)  # the entry holds 42 tokens
    second = request([*system, *range(500, 520)])  # 52 tokens: not beside 42
    scheduler.add(second)
    plan = step(scheduler)
    assert [type(op) for op in plan.memory_ops] == [Release, Evict]
    assert fed(plan) == {second.id: 52} and second.cached_tokens == 0


def test_without_a_cache_nothing_is_kept():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000, prefix_cache=False)
    first = request(40, max_new=1)
    scheduler.add(first)
    step(scheduler)
    assert scheduler.schedule().memory_ops == [Release(first.id)]
    again = request(list(first.prompt_ids))
    scheduler.add(again)
    assert fed(step(scheduler)) == {again.id: 40}


# --- the cache salt: reuse within one owner -------------------------------------------------


def salted(prompt: int | list[int], salt: str, max_new: int = 10) -> Request:
    made = request(prompt, max_new)
    made.cache_salt = salt
    return made


def test_an_entry_is_found_only_with_its_own_salt():
    cache = PrefixCache()
    system = list(range(1, 38))
    entry_id, _ = cache.insert([*system, 500], salt="owner:1")
    assert cache.lookup([*system, 600], limit=100, salt="owner:1") == (entry_id, 37)
    assert cache.lookup([*system, 600], limit=100, salt="owner:2") is None
    assert cache.lookup([*system, 600], limit=100) is None  # no salt is a salt of its own
    # the same tokens under another salt are an entry of their own, not redundant
    other_id, covered = cache.insert([*system, 500], salt="owner:2")
    assert other_id is not None and other_id != entry_id and covered == []
    assert cache.lookup([*system, 500], limit=100, salt="owner:2") == (other_id, 38)
    assert sorted(cache.salted({"owner:1"})) == [entry_id]
    assert sorted(cache.salted(None)) == sorted([entry_id, other_id])


def test_a_finished_request_s_prefix_is_reused_only_by_its_own_salt():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    first = salted(40, "owner:1", max_new=1)
    scheduler.add(first)
    step(scheduler)  # its 40 tokens become an entry of owner 1
    stranger, own = salted(list(first.prompt_ids), "owner:2"), salted(first.prompt_ids, "owner:1")
    scheduler.add(stranger)
    plan = step(scheduler)
    assert not any(isinstance(op, Adopt) for op in plan.memory_ops)
    assert fed(plan) == {stranger.id: 40} and stranger.cached_tokens == 0
    scheduler.add(own)
    plan = step(scheduler)
    assert any(isinstance(op, Adopt) for op in plan.memory_ops)
    assert fed(plan)[own.id] == 1 and own.cached_tokens == 39
    assert scheduler.stats.prefix_tokens_reused == 39


def test_a_running_request_is_shared_only_with_its_own_salt():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    first = salted(40, "owner:1")
    scheduler.add(first)
    step(scheduler)
    step(scheduler)
    assert first.num_computed == 41
    stranger = salted([*first.token_ids()[:41], 7], "owner:2")
    own = salted([*first.token_ids()[:41], 7], "owner:1")
    scheduler.add(stranger)
    scheduler.add(own)
    plan = step(scheduler)
    assert plan.memory_ops == [Share(own.id, first.id, 41, 42)]
    assert fed(plan) == {first.id: 1, stranger.id: 42, own.id: 1}
    assert (stranger.cached_tokens, own.cached_tokens) == (0, 41)


def test_forgetting_a_salt_drops_its_entries_and_keeps_nothing_of_its_requests():
    scheduler = Scheduler(max_batch=8, token_budget=1000, chunk_tokens=1000)
    kept, erased = salted(40, "owner:1", max_new=1), salted(40, "owner:2", max_new=1)
    for done in (kept, erased):
        scheduler.add(done)
        step(scheduler)
    running = salted(list(range(300, 340)), "owner:2")
    scheduler.add(running)
    step(scheduler)
    step(scheduler)  # it has computed 41 tokens
    (erased_entry,) = scheduler.cache.salted({"owner:2"})
    scheduler.forget({"owner:2"})
    plan = step(scheduler)
    assert plan.memory_ops == [Evict(erased_entry)]
    assert scheduler.cache.salted({"owner:2"}) == [] and len(scheduler.cache.salted(None)) == 1
    # what the running one computed is neither shared nor kept once it ends
    again = salted([*running.token_ids()[: running.num_computed], 7], "owner:2")
    repeat = salted(list(erased.prompt_ids), "owner:2")
    scheduler.add(again)
    scheduler.add(repeat)
    plan = step(scheduler)
    assert plan.memory_ops == [] and again.cached_tokens == repeat.cached_tokens == 0
    scheduler.abort(running, RequestStatus.FINISHED_STOPPED)
    assert Release(running.id) in scheduler.schedule().memory_ops
    assert scheduler.cache.salted({"owner:2"}) == []
    # owner 1's entry is untouched; forgetting every salt drops it too
    own = salted(list(kept.prompt_ids), "owner:1")
    scheduler.add(own)
    step(scheduler)
    assert own.cached_tokens == 39
    scheduler.forget(None)
    assert len(scheduler.cache) == 0


def test_a_preempted_request_frees_its_memory_for_the_others():
    """Its memory is what the others need: it is not kept as a cache entry."""
    scheduler = Scheduler(max_batch=8, token_budget=80, chunk_tokens=1000)
    first, second = request(30, max_new=40), request(list(range(500, 530)), max_new=40)
    scheduler.add(first)
    scheduler.add(second)
    while second.status != RequestStatus.PREEMPTED:
        plan = step(scheduler)
    assert Release(second.id) in plan.memory_ops and len(scheduler.cache) == 0


@pytest.mark.parametrize("budget", [0, -1])
def test_a_scheduler_needs_a_budget(budget):
    with pytest.raises(ValueError):
        Scheduler(max_batch=1, token_budget=budget, chunk_tokens=1)
