"""One owner never reuses, nor learns of, another owner's cached prefix
(issue "Security III"): the worker's prefix cache is salted by owner, and
the cached tokens each owner is told of (LMSP usage, ``/v1`` usage, the
usage counters of ``/metrics``) are their own. After an erasure is
announced, the owner's prefixes are gone from the worker too. Through the
real service: web, model worker, PostgreSQL, Redis and the model."""

from __future__ import annotations

import uuid
from collections.abc import Callable

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.db import transaction

from lmsp_core import erasure_news
from lmsp_core.redis_client import redis_client
from ops_app.collector import LmspCollector
from tasks_app.models import UsageRecord

from .conftest import make_token, parse_sse, request_body
from .stack import Stack


def memo() -> str:
    """A prompt no earlier request sent: a 60-word memo with a secret in it."""
    return (
        f"Memo {uuid.uuid4().hex}: the vault code for the north office is 4417, the courier "
        "arrives on Thursday at noon, and the board meets in room twelve to discuss the merger "
        "with Halvard Shipping. Nobody outside the finance team may read this memo. "
        "Summarise it in one word."
    )


def lmsp_cached(api: httpx.Client, text: str) -> int:
    """Send ``text`` through LMSP; the cached tokens its usage reports, which
    must be what its usage record (the usage pages' source) counted."""
    answer = api.post("/lmsp/v1/responses", json=request_body(text, max_output_tokens=2))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    cached = body["usage"]["input_tokens_details"]["cached_tokens"]
    record = UsageRecord.objects.get(response_id=body["id"])
    assert record.cached_tokens == cached
    assert 0 <= cached < body["usage"]["input_tokens"]
    return int(cached)


def lmsp_streamed_cached(api: httpx.Client, text: str) -> int:
    """The same, streamed: the usage of the final event."""
    body = request_body(text, max_output_tokens=2, stream=True)
    answer = api.post("/lmsp/v1/responses", json=body)
    assert answer.status_code == 200, answer.text
    final = parse_sse(answer.text)[-1]["data"]
    record = UsageRecord.objects.get(response_id=final["response_id"])
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == record.cached_tokens
    return int(record.cached_tokens)


def chat_cached(api: httpx.Client, text: str) -> int:
    answer = api.post(
        "/v1/chat/completions",
        json={
            "model": "smollm2:135m",
            "messages": [{"role": "user", "content": text}],
            "max_tokens": 2,
            "temperature": 0,
        },
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    return int(usage["prompt_tokens_details"]["cached_tokens"])


def openai_response_cached(api: httpx.Client, text: str) -> int:
    answer = api.post(
        "/v1/responses",
        json={"model": "smollm2:135m", "input": text, "max_output_tokens": 2, "temperature": 0},
    )
    assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    assert 0 <= usage["input_tokens_details"]["cached_tokens"] < usage["input_tokens"]
    return int(usage["input_tokens_details"]["cached_tokens"])


def cached_tokens_counter(username: str) -> float:
    """``lmsp_usage_cached_tokens_total`` of an owner, as /metrics computes it."""
    return sum(
        sample.value
        for family in LmspCollector().collect()
        for sample in family.samples
        if sample.name == "lmsp_usage_cached_tokens_total"
        and sample.labels.get("owner") == username
    )


@pytest.mark.usefixtures("token")  # which settles the generations after the test
@pytest.mark.parametrize(
    "cached_of", [lmsp_cached, lmsp_streamed_cached, chat_cached, openai_response_cached]
)
def test_an_owner_never_reuses_another_owner_s_prefix(
    stack: Stack, cached_of: Callable[[httpx.Client, str], int]
) -> None:
    """Owner B repeating owner A's memo computes it cold and is told 0 cached
    tokens (LMSP, streamed or not, /v1/chat/completions, /v1/responses);
    each owner's own repeat reuses their prefix and says so; the counters of
    /metrics say what each owner's usage says."""
    text = memo()
    with stack.client(make_token("ann")) as ann, stack.client(make_token("ben")) as ben:
        told = {
            "ann": [cached_of(ann, text), cached_of(ann, text)],
            "ben": [cached_of(ben, text), cached_of(ben, text)],
        }
    # ann's first is cold (a new owner), her repeat reuses her memo; ben is
    # told nothing of hers, and his own repeat reuses his
    for first, repeat in told.values():
        assert first == 0 and repeat > 20
    for username, answers in told.items():
        records = UsageRecord.objects.filter(owner__username=username)
        assert sorted(record.cached_tokens for record in records) == sorted(answers)
        assert cached_tokens_counter(username) == sum(answers)


def test_after_an_erasure_the_owner_s_prefixes_are_computed_cold(stack: Stack, token: str) -> None:
    """Once an erasure of alice's text is announced, the worker has dropped her
    cached prefixes: her repeat computes its memo cold, while bob's (not
    erased) still reuses his."""
    alice = get_user_model().objects.get(username="alice")
    bob = make_token("bob")
    # the model worker listens from its start
    assert redis_client().pubsub_numsub(erasure_news.CHANNEL)[0][1] >= 1
    text, other = memo(), memo()
    with stack.client(token) as alice_api, stack.client(bob) as bob_api:
        assert lmsp_cached(alice_api, text) == 0
        assert lmsp_cached(alice_api, text) > 20  # cached: the same again would reuse it
        assert lmsp_cached(bob_api, other) == 0
        with transaction.atomic():
            erasure_news.announce_erasure([alice.pk])
        assert lmsp_cached(bob_api, other) > 20  # bob's prefixes stay
        assert lmsp_cached(alice_api, text) == 0  # alice's went
        assert lmsp_cached(alice_api, text) > 20  # and her new ones are cached again


def test_a_delete_empties_the_worker_s_cache_of_the_erased_words(stack: Stack, token: str) -> None:
    """The whole path, as an owner sees it: DELETE of a stored response
    reaches the worker, whose next request of that owner computes the same
    words cold instead of reusing them."""
    text = memo()
    with stack.client(token) as api:
        stored = request_body(text, max_output_tokens=2, store=True)
        first = api.post("/lmsp/v1/responses", json=stored)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert lmsp_cached(api, text) > 20  # the words are in the worker's cache
        erased = api.delete(f"/lmsp/v1/responses/{first.json()['id']}")
        assert erased.status_code == 200, erased.text
        assert lmsp_cached(api, text) == 0
