"""The batching engine on the real SmolLM2 model, in process.

Every batched greedy output is compared token for token with the same
request generated alone through ``tests.reference.generate`` (transformers'
own ``model.generate``): batching must change throughput, never answers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time

import jsonschema
import pytest
import torch

from engine import linear, native, row_products
from engine.client import BatchingEngine, Generation, engine_for
from engine.interface import SamplingParams
from engine.linear import Product, can_pack
from generation import prompts
from generation.params import GenerationParams
from generation.tokens import prompt_tokenizer
from workers import constraints, loading
from workers.loading import engine_threads, load_model

from . import reference

pytestmark = pytest.mark.model  # the real model, loaded in this process

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
}
# Different prompt lengths and token limits, so rows join padded and leave
# at different steps (some end on their own before their limit).
QUESTIONS = [
    ("Say hello.", 24),
    ("What is the capital of France? Answer in one sentence.", 28),
    ("Write a haiku about the sea.", 40),
    ("List three fruits.", 32),
    ("Explain gravity to a child in two sentences.", 36),
    ("Count from one to ten in words.", 40),
    ("Why is the sky blue?", 30),
    ("Give me a name for a cat, and tell me why you chose it.", 34),
]
PERSON_PARAMS = GenerationParams(
    response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
)


def message(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def prompt_ids(lm, text: str, params: GenerationParams | None = None) -> list[int]:
    tokenizer = prompt_tokenizer(lm.spec)
    rendered = prompts.render_prompt(
        lm.spec, tokenizer, [message(text)], params or GenerationParams()
    )
    return lm.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def generate_alone(lm, ids: list[int], limit: int) -> list[int]:
    """Greedy tokens of one request through the unbatched path, end token included."""
    out: list[int] = []
    reference.generate(
        lm,
        ids,
        SamplingParams(max_tokens=limit, temperature=0),
        lambda token_id: out.append(token_id) or False,
    )
    return out


def first_difference(lm, ids: list[int], alone: list[int], batched: list[int]) -> str:
    """Where two outputs part, and how close the unbatched logits were there."""
    at = next(
        (i for i, (a, b) in enumerate(zip(alone, batched, strict=False)) if a != b),
        min(len(alone), len(batched)),
    )
    if at == min(len(alone), len(batched)):
        return f"lengths differ: {len(alone)} alone, {len(batched)} batched"
    with torch.inference_mode():
        logits = lm.model(torch.tensor([ids + alone[:at]])).logits[0, -1].float()
    gap = float(logits[alone[at]] - logits[batched[at]])
    return (
        f"first difference at token {at}: alone {alone[at]}, batched {batched[at]}; "
        f"logit gap between them when alone {gap:.3g}"
    )


def assert_same(lm, ids: list[int], alone: list[int], gen: Generation) -> None:
    assert gen.error is None, gen.error
    assert gen.token_ids == alone, first_difference(lm, ids, alone, gen.token_ids)


def wait_for_tokens(gen: Generation, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(gen.token_ids) < count and not gen.done:
        assert time.monotonic() < deadline, "no tokens came"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def requests(lm) -> list[tuple[list[int], int, list[int]]]:
    """(prompt ids, token limit, unbatched greedy output) per question."""
    out = []
    for text, limit in QUESTIONS:
        ids = prompt_ids(lm, text)
        out.append((ids, limit, generate_alone(lm, ids, limit)))
    return out


@pytest.fixture(scope="module")
def batching(lm):  # noqa: ANN201
    running = BatchingEngine(lm, max_batch=8)
    yield running
    running.close(timeout=60)


def greedy(limit: int) -> SamplingParams:
    return SamplingParams(max_tokens=limit, temperature=0)


def answered_together(lm, requests, **options) -> list[Generation]:  # noqa: ANN001
    """``requests`` (prompt ids, limit, ...) submitted at once to an engine of
    their own (``options``: the engine's), each finished."""
    running = BatchingEngine(lm, max_batch=8, **options)
    try:
        gens = [running.add_request(ids, greedy(limit)) for ids, limit, *_ in requests]
        for gen in gens:
            assert gen.wait(300)
    finally:
        running.close(timeout=60)
    return gens


def test_eight_concurrent_greedy_requests_equal_their_solo_outputs(lm, requests, batching):
    gens = [batching.add_request(ids, greedy(limit)) for ids, limit, _ in requests]
    for gen in gens:
        assert gen.wait(300)
    for (ids, _, alone), gen in zip(requests, gens, strict=True):
        assert_same(lm, ids, alone, gen)
        ended_alone = alone[-1] in lm.eos_token_ids
        assert gen.finish_reason == ("eos" if ended_alone else "length")
    # the outputs really came from one batch: rows ran side by side
    assert max(g.first_token_at for g in gens) < min(g.finished_at for g in gens)
    deadline = time.monotonic() + 5  # the engine updates its count after the last token
    while batching.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert batching.running == 0 and batching.waiting == 0


def test_grammar_and_free_requests_share_a_batch(lm, requests, batching):
    params = PERSON_PARAMS
    grammar = constraints.compiled_grammar(lm, params)
    json_ids = prompt_ids(lm, "Invent a person.", params)
    free_ids, free_limit, free_alone = requests[2]
    constrained = batching.add_request(json_ids, greedy(48), grammar=grammar)
    free = batching.add_request(free_ids, greedy(free_limit))
    sampled = batching.add_request(free_ids, SamplingParams(max_tokens=24, temperature=0.8))
    for gen in (constrained, free, sampled):
        assert gen.wait(300)
    assert constrained.error is None and constrained.finish_reason == "eos"
    answer = json.loads(lm.tokenizer.decode(constrained.token_ids, skip_special_tokens=True))
    jsonschema.validate(answer, PERSON)
    assert_same(lm, free_ids, free_alone, free)  # a masked neighbour changes nothing
    assert sampled.error is None and len(sampled.token_ids) > 0


def test_cancelling_one_of_eight_leaves_the_others_exact(lm, requests, batching):
    victim = 5  # its greedy answer runs to its limit, so it is still going when cancelled
    assert len(requests[victim][2]) == requests[victim][1]
    gens = [batching.add_request(ids, greedy(limit)) for ids, limit, _ in requests]
    wait_for_tokens(gens[victim], 6)
    gens[victim].cancel()
    had = len(gens[victim].token_ids)
    for gen in gens:
        assert gen.wait(300)
    assert gens[victim].finish_reason == "cancelled"
    assert len(gens[victim].token_ids) <= had + 1  # gone within one decoding step
    assert gens[victim].token_ids == requests[victim][2][: len(gens[victim].token_ids)]
    for row, ((ids, _, alone), gen) in enumerate(zip(requests, gens, strict=True)):
        if row != victim:
            assert_same(lm, ids, alone, gen)


def test_a_failing_or_stopping_callback_ends_only_its_own_request(lm, requests, batching):
    def explode(token_id: int) -> bool:
        if len(exploding.token_ids) == 3:
            raise ValueError("the consumer broke")
        return False

    stopping_seen: list[int] = []

    def stop_after_five(token_id: int) -> bool:
        stopping_seen.append(token_id)
        return len(stopping_seen) == 5

    (ids0, _, alone0), (ids1, _, alone1), (ids2, limit2, alone2) = (
        requests[3],
        requests[5],
        requests[4],
    )
    exploding = batching.add_request(ids0, greedy(16), explode)
    stopping = batching.add_request(ids1, greedy(16), stop_after_five)
    healthy = batching.add_request(ids2, greedy(limit2))
    for gen in (exploding, stopping, healthy):
        assert gen.wait(300)
    assert exploding.finish_reason == "error" and isinstance(exploding.error, ValueError)
    assert exploding.token_ids == alone0[:3]
    assert stopping.finish_reason == "stopped" and stopping.token_ids == alone1[:5]
    assert stopping_seen == stopping.token_ids
    assert_same(lm, ids2, alone2, healthy)


def test_a_request_joins_while_others_decode(lm, requests, batching):
    running = [batching.add_request(ids, greedy(limit)) for ids, limit, _ in requests[4:7]]
    wait_for_tokens(running[0], 4)
    joined_at = time.monotonic()
    ids, _, alone = requests[1]
    joiner = batching.add_request(ids, greedy(8))
    assert joiner.wait(300)
    for gen in running:
        assert gen.wait(300)
    assert all(gen.finished_at > joined_at for gen in running)  # they were still decoding
    assert joiner.first_token_at < min(gen.finished_at for gen in running)
    assert joiner.token_ids == alone[:8]
    for (ids, _, alone), gen in zip(requests[4:7], running, strict=True):
        assert_same(lm, ids, alone, gen)


def test_resuming_from_a_prefix_continues_as_an_uninterrupted_run(lm, requests, batching):
    params = PERSON_PARAMS
    grammar = constraints.compiled_grammar(lm, params)
    json_ids = prompt_ids(lm, "Invent a person.", params)
    free_ids, free_limit, free_alone = requests[5]
    whole = batching.add_request(json_ids, greedy(40), grammar=grammar)
    assert whole.wait(300) and whole.error is None
    cut = 12
    assert len(whole.token_ids) > cut and len(free_alone) > cut
    resumed_json = batching.add_request(
        json_ids, greedy(40 - cut), generated_ids=whole.token_ids[:cut], grammar=grammar
    )
    resumed_free = batching.add_request(
        free_ids, greedy(free_limit - cut), generated_ids=free_alone[:cut]
    )
    for gen in (resumed_json, resumed_free):
        assert gen.wait(300) and gen.error is None
    assert resumed_json.token_ids == whole.token_ids[cut:]
    assert resumed_free.token_ids == free_alone[cut:]
    jsonschema.validate(json.loads(lm.tokenizer.decode(whole.token_ids[:-1])), PERSON)


def test_tokens_that_break_the_grammar_fail_only_that_resume(lm, batching):
    params = PERSON_PARAMS
    grammar = constraints.compiled_grammar(lm, params)
    ids = prompt_ids(lm, "Invent a person.", params)
    broken = lm.tokenizer("Hello", add_special_tokens=False)["input_ids"]
    gen = batching.add_request(ids, greedy(8), generated_ids=broken, grammar=grammar)
    assert gen.wait(60)
    assert gen.finish_reason == "error" and "breaks the grammar" in str(gen.error)


def test_stream_yields_the_tokens_then_ends(lm, requests, batching):
    ids, _, alone = requests[0]
    gen = batching.add_request(ids, greedy(10))
    assert list(gen.stream(timeout=120)) == alone[:10]
    assert gen.done


def test_a_draining_engine_preempts_every_generation_and_every_later_one(lm, requests):
    """A worker told to stop drains its engine: what runs and what waits ends
    ``preempted`` with the tokens it has (its job hands it back), and so does
    whatever is submitted after."""
    batching = BatchingEngine(lm, max_batch=1)
    try:
        # "Count from one to ten in words." answers in far more tokens than
        # the engine makes between the first one and the drain
        (first, _, alone), (second, _, _) = requests[5], requests[6]
        running = batching.add_request(first, greedy(400))
        waiting = batching.add_request(second, greedy(400))  # no room: it waits
        started = next(running.stream(timeout=120))
        batching.drain()
        assert running.wait(60) and waiting.wait(60)
        assert (running.finish_reason, waiting.finish_reason) == ("preempted", "preempted")
        assert running.token_ids[0] == started
        assert 1 <= len(running.token_ids) < len(alone)
        assert running.token_ids == alone[: len(running.token_ids)]  # its tokens so far
        assert waiting.token_ids == []
        later = batching.add_request(first, greedy(4))
        assert later.wait(60) and later.finish_reason == "preempted"
    finally:
        batching.close(timeout=60)


def test_a_request_cancelled_alone_leaves_its_prefix_for_the_next_one(lm, requests):
    """A request cancelled with nothing else running ends in a step that
    computes nothing; what it computed still goes to the prefix cache, and the
    next request with its prompt adopts it and answers as alone (a CI run
    failed that request with KeyError: the cache said the entry was there,
    the model runner never got it)."""
    batching = BatchingEngine(lm, max_batch=2)
    try:
        ids, _, alone = requests[5]
        submitted: list[Generation] = []

        def cancel_after_the_first_token(_: int) -> None:
            # on the engine thread, after this token's check: the cancel is
            # found at the start of the next step, which then computes nothing
            submitted[0].cancel()

        submitted.append(batching.add_request(ids, greedy(400), cancel_after_the_first_token))
        cancelled = submitted[0]
        assert cancelled.wait(60) and cancelled.finish_reason == "cancelled"
        assert len(cancelled.token_ids) == 1
        again = batching.add_request(ids, greedy(len(alone)))
        assert again.wait(120) and again.error is None, again.error
        assert again.cached_tokens > 0
        assert again.token_ids == alone
    finally:
        batching.close(timeout=60)


def test_one_engine_per_loaded_model(lm):
    first = engine_for(lm)
    try:
        assert engine_for(lm, max_batch=4) is first and first.max_batch == 8
    finally:
        first.close(timeout=60)
    second = engine_for(lm)
    assert second is not first
    second.close(timeout=60)


# --- the engine II: chunks, the prefix cache, the budget -----------------------------------


def test_prompts_computed_in_chunks_beside_decoding_rows_answer_as_alone(lm, requests):
    """A chunk of 8 tokens a step: every prompt takes several steps, beside the
    rows already decoding, and every answer is still the one it gets alone."""
    chunked = BatchingEngine(lm, max_batch=8, chunk_tokens=8)
    try:
        first = [chunked.add_request(ids, greedy(limit)) for ids, limit, _ in requests[:4]]
        wait_for_tokens(first[0], 2)
        later = [chunked.add_request(ids, greedy(limit)) for ids, limit, _ in requests[4:]]
        for gen in first + later:
            assert gen.wait(300)
    finally:
        chunked.close(timeout=60)
    for (ids, _, alone), gen in zip(requests, first + later, strict=True):
        assert_same(lm, ids, alone, gen)
    # Every prompt token once: computed in a chunk, or (the later ones' system
    # prompt) copied from what a running request had computed.
    counts = chunked.stats().counts
    reused = sum(gen.cached_tokens for gen in later)
    assert all(gen.cached_tokens == 0 for gen in first) and reused > 0
    assert counts.prefix_tokens_reused == reused
    assert counts.prompt_tokens_computed + reused == sum(len(r[0]) for r in requests)


def test_a_follow_up_reuses_its_conversation_and_answers_as_computed_whole(lm, requests):
    ids, limit, alone = requests[2]
    cached = BatchingEngine(lm, max_batch=8)
    uncached = BatchingEngine(lm, max_batch=8, prefix_cache=False)
    try:
        first = cached.add_request(ids, greedy(limit))
        assert first.wait(300) and first.token_ids == alone
        # the next turn: the history as the model wrote it, then a new message
        next_turn = "<|im_end|>\n<|im_start|>user\nShorter?<|im_end|>\n<|im_start|>assistant\n"
        turn = lm.tokenizer(next_turn, add_special_tokens=False)["input_ids"]
        follow_up_ids = [*ids, *alone[:-1], *turn]
        follow_up = cached.add_request(follow_up_ids, greedy(24))
        whole = uncached.add_request(follow_up_ids, greedy(24))
        assert follow_up.wait(300) and whole.wait(300)
    finally:
        cached.close(timeout=60)
        uncached.close(timeout=60)
    assert follow_up.cached_tokens == len(ids) + len(alone) - 1  # all it fed: not its end
    assert whole.cached_tokens == 0
    assert follow_up.token_ids == whole.token_ids == generate_alone(lm, follow_up_ids, 24)
    counts = cached.stats().counts
    assert counts.prefix_hits == 1 and counts.prefix_tokens_reused == follow_up.cached_tokens


def test_requests_sharing_what_a_running_one_computed_answer_as_alone(lm, requests):
    """A generation handed over mid-way (its tokens so far resumed) and
    another question with the same system prompt arrive while the first
    runs: they copy what it has computed, and each answer is still its own
    alone."""
    ids, limit, alone = requests[5]
    other_ids, other_limit, other_alone = requests[6]
    sharing = BatchingEngine(lm, max_batch=8)
    try:
        first = sharing.add_request(ids, greedy(limit))
        wait_for_tokens(first, 12)
        cut = 10
        resumed = sharing.add_request(ids, greedy(limit - cut), generated_ids=alone[:cut])
        other = sharing.add_request(other_ids, greedy(other_limit))
        for gen in (first, resumed, other):
            assert gen.wait(300)
    finally:
        sharing.close(timeout=60)
    assert_same(lm, ids, alone, first)
    assert resumed.error is None and resumed.token_ids == alone[cut:]
    assert_same(lm, other_ids, other_alone, other)
    common = next(i for i, (a, b) in enumerate(zip(ids, other_ids, strict=False)) if a != b)
    assert resumed.cached_tokens == len(ids) + cut - 1  # all it fed but its last
    assert other.cached_tokens == common  # the system prompt and the turn's start
    counts = sharing.stats().counts
    assert counts.prompt_tokens_computed == len(ids) + 1 + len(other_ids) - common


def test_an_engine_on_a_cpu_steps_on_every_core(lm, requests):
    ids, _, alone = requests[0]
    available = torch.get_num_threads()
    assert lm.threads == available
    assert engine_threads(dataclasses.replace(lm.spec, cpu_threads=3), "cpu", available) == 3
    assert engine_threads(lm.spec, "cuda", available) == 0
    threads: list[int] = []
    counting = BatchingEngine(lm, max_batch=2)
    try:
        gen = counting.add_request(
            ids, greedy(3), on_token=lambda _: threads.append(torch.get_num_threads()) or False
        )
        assert gen.wait(120) and gen.token_ids == alone[:3]
    finally:
        counting.close(timeout=60)
    assert threads == [lm.threads] * 3
    assert torch.get_num_threads() == available  # the caller's own count is left as it was


def test_a_model_loads_on_a_thread_that_ends_with_the_load(lm, monkeypatch):
    """Not on the caller's: the OpenMP pool a load leaves on its thread would
    make the engine thread's pool sleep between products (workers.loading)."""
    loaders: list[threading.Thread] = []

    def load(spec):
        loaders.append(threading.current_thread())
        return lm

    monkeypatch.setattr(loading, "_load", load)
    assert loading.load_model.__wrapped__(lm.spec) is lm
    assert loaders and loaders[0] is not threading.current_thread()
    assert not loaders[0].is_alive()


def test_an_engine_sharing_its_cores_steps_on_half_its_threads(lm, requests):
    ids, _, alone = requests[0]
    sharing = BatchingEngine(lm, max_batch=2)
    threads: list[int] = []
    try:
        sharing.share_cores()
        gen = sharing.add_request(
            ids, greedy(4), on_token=lambda _: threads.append(torch.get_num_threads()) or False
        )
        assert gen.wait(120) and gen.token_ids == alone[:4]
    finally:
        sharing.close(timeout=60)
    half = max(1, torch.get_num_threads() // 2)
    assert threads == [half] * 4


def test_a_request_without_room_is_preempted_and_its_resume_continues_exactly(lm, requests):
    """Two requests whose prompts fit together but whose answers do not: the
    one admitted last leaves as ``preempted`` when memory runs out, and
    resumed from its tokens (as the worker does from its checkpoint) it ends
    as it would have alone."""
    (ids0, limit0, alone0), (ids1, limit1, alone1) = requests[5], requests[6]
    budget = len(ids0) + len(ids1) + 20
    small = BatchingEngine(lm, max_batch=8, token_budget=budget)
    try:
        first = small.add_request(ids0, greedy(limit0))
        second = small.add_request(ids1, greedy(limit1))
        assert first.wait(300) and second.wait(300)
        assert first.finish_reason == "length" and second.finish_reason == "preempted"
        assert 0 < len(second.token_ids) < limit1
        resumed = small.add_request(
            ids1, greedy(limit1 - len(second.token_ids)), generated_ids=second.token_ids
        )
        assert resumed.wait(300)
    finally:
        small.close(timeout=60)
    assert_same(lm, ids0, alone0, first)
    assert second.token_ids + resumed.token_ids == alone1
    assert small.stats().counts.preemptions == 1


def test_the_eager_kernel_batches_as_the_sdpa_one(lm, requests):
    eager_lm = load_model(dataclasses.replace(lm.spec, attention="eager"))
    assert eager_lm.model.config._attn_implementation == "eager"
    assert eager_lm.decoder.kernel == "eager"
    gens = answered_together(eager_lm, requests[:3], chunk_tokens=16)
    for (ids, limit, _), gen in zip(requests[:3], gens, strict=True):
        assert gen.error is None
        assert gen.token_ids == generate_alone(eager_lm, ids, limit)


def test_packed_linear_layers_answer_as_transformers_own(lm, requests):
    """On a CPU the engine computes its linear layers with weights packed for
    oneDNN (and in blocks, for a decoding step's rows); the engine's greedy
    answers equal those of the same weights through transformers' own
    layers, one request at a time."""
    packs = can_pack(lm.model.device, lm.model.dtype)
    assert (lm.decoder.head.packed is not None) == packs
    plain = load_model(dataclasses.replace(lm.spec, linear="torch"))
    assert type(plain.model.lm_head) is torch.nn.Linear
    products = [plain.decoder.head] + [layer.qkv for layer in plain.decoder.layers]
    assert all(p.packed is None and p.blocks is None for p in products)
    gens = answered_together(lm, requests)
    for (ids, limit, _), gen in zip(requests, gens, strict=True):
        assert_same(plain, ids, generate_alone(plain, ids, limit), gen)
    # Insisting where it cannot pack is refused before any weight is read.
    with pytest.raises(ValueError, match='linear = "packed" needs float32 on a CPU'):
        load_model(dataclasses.replace(lm.spec, linear="packed", dtype="bfloat16"))


def test_a_decoding_steps_rows_are_computed_in_blocks_each_as_alone(
    lm, requests, tmp_path, monkeypatch, caplog
):
    """The row products (``engine.row_products``) give ``F.linear``'s answers
    within its rounding, each row the same bits as alone. ``linear = "auto"``
    computes a step of up to ``blocked_rows`` rows (as this CPU timed the
    layouts, once a process) with them, and a wider step (a prompt's chunk)
    with the packed weight; ``packed`` holds the packed weights alone and
    gives the same greedy answers; ``torch`` is ``F.linear``. Where the
    function cannot be built, ``auto`` packs alone."""
    if not can_pack(lm.model.device, lm.model.dtype):
        pytest.skip("torch's own products are kept here (the test above)")
    if native.compiler() is None:
        pytest.skip("no C compiler to build the row products with")
    limit = linear.blocked_rows()
    # Timed once a process, not at each of the loaded model's 121 products.
    assert linear.blocked_rows.cache_info().misses == 1
    assert limit in (0, *linear.TIMED_ROWS)
    layer = torch.nn.Linear(64, 37)  # a last block of 5 columns
    weight, bias = layer.weight.detach(), layer.bias.detach()
    auto, packed = Product(weight, bias, "auto"), Product(weight, bias, "packed")
    plain = Product(weight, bias, "torch")
    assert (auto.blocks is not None) == (limit > 0)
    assert packed.blocks is None and packed.weight is None
    products = row_products.load()
    assert products is not None  # a compiler is here: it must build and pass its check
    blocks, blocked_bias = products.lay_out(weight), products.lay_out(bias)
    with torch.inference_mode():
        for rows in sorted({1, 2, 3, 8, 9, 17, 33, limit, limit + 1} - {0}):
            x = torch.randn(rows, 64)
            by_torch = torch.nn.functional.linear(x, weight, bias)
            together = products(x, blocks, blocked_bias, 37)
            assert torch.allclose(together, by_torch, atol=1e-5, rtol=1e-5)
            for row in range(rows):
                alone = products(x[row : row + 1], blocks, blocked_bias, 37)
                assert torch.equal(alone, together[row : row + 1])
            by_packed = torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")
            assert torch.equal(packed(x), by_packed)
            assert torch.equal(plain(x), by_torch)
            assert torch.equal(auto(x), together if rows <= limit else by_packed)
    # The worker's default, "auto", as loaded.
    assert (lm.decoder.head.blocks is not None) == (limit > 0)
    packed_only = load_model(dataclasses.replace(lm.spec, linear="packed"))
    layers = packed_only.decoder.layers
    layer_products = [packed_only.decoder.head]
    layer_products += [p for layer in layers for p in (layer.qkv, layer.down)]
    assert all(p.packed is not None and p.blocks is None for p in layer_products)
    gens = answered_together(packed_only, requests)
    for (ids, _, alone), gen in zip(requests, gens, strict=True):
        assert_same(packed_only, ids, alone, gen)
    # No compiler: the blocks are not laid out, every step is packed.
    monkeypatch.setenv("LMSP_KERNEL_CACHE", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    row_products.load.cache_clear()
    linear.blocked_rows.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.row_products"):
            fallback = Product(weight, bias, "auto")
        assert "fall back to oneDNN's kernel" in caplog.text
        assert fallback.blocks is None and fallback.packed is not None
        x = torch.randn(2, 64)
        with torch.inference_mode():
            by_packed = torch.ops.mkldnn._linear_pointwise(x, packed.packed, bias, "none", [], "")
            assert torch.equal(fallback(x), by_packed)
    finally:  # built and timed again where the environment says, once undone
        row_products.load.cache_clear()
        linear.blocked_rows.cache_clear()
