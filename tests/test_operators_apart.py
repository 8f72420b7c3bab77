"""Operators and owners apart (issue 46): ``/metrics`` names owners, and
models a token may not use, only to an operator's token
(``metrics:operator``); an owner reads their own usage, the admin's numbers
for them, from ``GET /lmsp/v1/usage`` (``usage:read``), and nobody else's."""

from __future__ import annotations

from datetime import date

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from accounts_app.services import create_token
from ops_app import recorders, usage_report
from tasks_app.models import DailyUsage, OwnerQuota

pytestmark = pytest.mark.django_db

SHIPPED = "smollm2:135m"
HIDDEN = "hidden:1b"  # a model alice may not use
# (owner, model, day, requests, input, output, cached, worker seconds)
DAYS = [
    ("alice", SHIPPED, date(2026, 11, 1), 2, 20, 8, 4, 2.0),
    ("alice", HIDDEN, date(2026, 11, 1), 1, 7, 3, 0, 0.5),
    ("alice", SHIPPED, date(2026, 11, 30), 3, 30, 12, 6, 3.25),
    ("alice", SHIPPED, date(2026, 12, 1), 1, 1, 1, 0, 0.25),
    ("bob", SHIPPED, date(2026, 11, 2), 4, 40, 16, 0, 4.0),
    ("bob", HIDDEN, date(2026, 11, 3), 5, 50, 20, 0, 5.0),
]


@pytest.fixture
def owners() -> dict[str, int]:
    """alice (who may use the shipped model only) and bob, with the usage of
    ``DAYS``; their ids."""
    users = {name: get_user_model().objects.create_user(name) for name in ("alice", "bob")}
    for owner, model, day, *figures in DAYS:
        DailyUsage.objects.create(
            owner=users[owner],
            model=model,
            day=day,
            **dict(zip(usage_report.FIGURES, figures, strict=True)),
        )
    OwnerQuota.objects.create(owner=users["alice"], allowed_models=[SHIPPED])
    return {name: user.pk for name, user in users.items()}


def scrape(token: str) -> tuple[str, dict[tuple[str, tuple], float]]:
    answer = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 200, answer.content
    text = answer.content.decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return text, samples


@pytest.fixture
def recorded(broker) -> None:  # noqa: ANN001
    """Output tokens of both models counted in Redis, as the workers count them."""
    client, _ = broker
    client.hset(recorders.OUTPUT_TOKENS_KEY, mapping={SHIPPED: 7, HIDDEN: 5})
    yield
    client.delete(recorders.OUTPUT_TOKENS_KEY)


def test_a_plain_metrics_token_sees_no_owner_and_no_model_it_may_not_use(owners, recorded):
    text, samples = scrape(create_token(username="alice", scopes=["metrics:read"]).secret)
    assert samples[("lmsp_redis_up", ())] == 1
    labels = [dict(labels) for _, labels in samples]
    assert not [found for found in labels if "owner" in found]
    assert not [found for found in labels if found.get("model") == HIDDEN]
    assert "bob" not in text and HIDDEN not in text
    shipped = (("model", SHIPPED),)
    # the shipped model's usage, added up over its owners
    assert samples[("lmsp_usage_requests_total", shipped)] == 2 + 3 + 1 + 4
    assert samples[("lmsp_usage_output_tokens_total", shipped)] == 8 + 12 + 1 + 16
    assert samples[("lmsp_output_tokens_total", shipped)] == 7


def test_an_operator_token_sees_each_owner_and_every_model(owners, recorded):
    _, samples = scrape(create_token(username="ops", scopes=["metrics:operator"]).secret)

    def of(owner: str, model: str) -> tuple:
        return (("model", model), ("owner", owner))

    assert samples[("lmsp_usage_requests_total", of("alice", SHIPPED))] == 6
    assert samples[("lmsp_usage_requests_total", of("alice", HIDDEN))] == 1
    assert samples[("lmsp_usage_requests_total", of("bob", HIDDEN))] == 5
    assert samples[("lmsp_output_tokens_total", (("model", HIDDEN),))] == 5


def test_metrics_still_need_one_of_the_metrics_scopes(owners):
    token = create_token(username="alice", scopes=["usage:read", "models:read"]).secret
    answer = Client().get("/metrics", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 403 and answer.json()["code"] == "insufficient_scope"


def usage(token: str, **query: str) -> dict:
    answer = Client().get("/lmsp/v1/usage", query, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 200, answer.content
    return answer.json()


def test_an_owner_reads_its_own_usage_as_the_admin_reports_it(owners):
    token = create_token(username="alice", scopes=["usage:read"]).secret
    november = usage(token, **{"from": "2026-11-01", "to": "2026-11-30"})
    assert november["object"] == "usage"
    assert (november["from"], november["to"], november["by"]) == ("2026-11-01", "2026-11-30", "day")
    admin = usage_report.report(
        usage_report.filters_from({"from": "2026-11-01", "to": "2026-11-30"}, owners["alice"])
    )
    assert [
        [row["period"], row["model"], *(row[figure] for figure in usage_report.FIGURES)]
        for row in november["data"]
    ] == [
        [row.period.isoformat(), row.model, *(getattr(row, f) for f in usage_report.FIGURES)]
        for row in admin.rows
    ]
    assert [row["model"] for row in november["data"]] == [HIDDEN, SHIPPED, SHIPPED]
    assert november["total"] == {
        "requests": 6,
        "input_tokens": 57,
        "output_tokens": 23,
        "cached_tokens": 10,
        "worker_seconds": 5.75,
    }
    months = usage(token, **{"from": "2026-11-01", "to": "2026-12-31", "by": "month"})
    assert [(row["period"], row["model"], row["requests"]) for row in months["data"]] == [
        ("2026-11", HIDDEN, 1),
        ("2026-11", SHIPPED, 5),
        ("2026-12", SHIPPED, 1),
    ]
    one_model = usage(token, **{"from": "2026-11-01", "to": "2026-11-30", "model": SHIPPED})
    assert one_model["total"]["requests"] == 5
    bobs = usage(
        create_token(username="bob", scopes=["usage:read"]).secret,
        **{"from": "2026-11-01", "to": "2026-11-30"},
    )
    assert {row["model"] for row in bobs["data"]} == {SHIPPED, HIDDEN}
    assert bobs["total"]["requests"] == 9  # bob's own, none of alice's


@pytest.mark.parametrize(
    ("query", "param", "words"),
    [
        ({"from": "someday"}, "from", "from must be a date"),
        ({"to": "20261130"}, "to", "to must be a date"),
        ({"from": "2026-11-02", "to": "2026-11-01"}, "from", "is after to"),
        ({"from": "0001-01-01", "to": "9999-12-31"}, "to", "at most 366 days"),
        ({"by": "week"}, "by", "by must be day or month"),
        ({"preset": "forever"}, "preset", "unknown preset"),
        ({"owner": "bob"}, "owner", "Unknown query parameter"),
        ({"by": ""}, "by", "by is empty"),
        ({"preset": "this_month", "to": "2026-11-30"}, "preset", "give it or from and to"),
    ],
)
def test_bad_usage_filters_are_problem_documents(owners, query, param, words):
    token = create_token(username="alice", scopes=["usage:read"]).secret
    answer = Client().get("/lmsp/v1/usage", query, HTTP_AUTHORIZATION=f"Bearer {token}")
    assert answer.status_code == 400
    assert answer["Content-Type"] == "application/problem+json"
    problem = answer.json()
    assert (problem["code"], problem["param"]) == ("invalid_request", param)
    assert words in problem["detail"]


def test_usage_needs_its_scope(owners):
    token = create_token(username="alice", scopes=["metrics:read"]).secret
    refused = Client().get("/lmsp/v1/usage", HTTP_AUTHORIZATION=f"Bearer {token}")
    assert refused.status_code == 403 and refused.json()["code"] == "insufficient_scope"
    assert Client().get("/lmsp/v1/usage").status_code == 401
