"""GET /metrics on the test stack: Prometheus text from Redis and PostgreSQL,
moving when a generation runs through HTTP; job health on the dashboard."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lmsp_core.redis_client import redis_client
from ops_app import jobs, recorders

from .conftest import LONG_STORY, make_token, parse_sse, request_body
from .stack import LOGS

pytestmark = pytest.mark.e2e

MODEL = "smollm2:135m"


def scrape(stack, token: str) -> dict[tuple[str, tuple], float]:
    """Every sample of a scrape, by name and sorted labels."""
    with stack.client(token) as client:
        answer = client.get("/metrics")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture
def metrics_token(transactional_db) -> str:  # noqa: ANN001
    return make_token("prometheus", ["metrics:read"])


def test_metrics_need_a_token_with_the_metrics_scope(stack, token, transactional_db):  # noqa: ANN001
    with stack.client("") as client:
        missing = client.get("/metrics", headers={"Authorization": ""})
    assert missing.status_code == 401
    assert missing.headers["content-type"] == "application/problem+json"
    with stack.client(make_token("bob", ["models:read"])) as client:
        refused = client.get("/metrics")
    assert refused.status_code == 403
    assert refused.json()["code"] == "insufficient_scope"


def test_series_move_when_a_generation_runs(stack, api, metrics_token):
    before = scrape(stack, metrics_token)
    assert value(before, "lmsp_workers_alive", model=MODEL) >= 1
    assert ("lmsp_generations_queued", (("model", MODEL),)) in before
    assert ("lmsp_generations_running", (("model", MODEL),)) in before
    body = request_body(LONG_STORY, stream=True, max_output_tokens=64)
    with api.stream("POST", "/lmsp/v1/responses", json=body) as answer:
        assert answer.status_code == 200
        chunks = answer.iter_text()
        raw = ""
        while "response.output_text.delta" not in raw:  # the worker is generating
            raw += next(chunks)
        during = scrape(stack, metrics_token)  # and the stream is open: we are reading it
        raw += "".join(chunks)
    usage = parse_sse(raw)[-1]["data"]["usage"]
    after = scrape(stack, metrics_token)

    assert value(during, "lmsp_sse_streams_open") >= 1
    in_flight = value(during, "lmsp_generations_queued", model=MODEL) + value(
        during, "lmsp_generations_running", model=MODEL
    )
    assert in_flight >= 1  # the generation we are reading (63 tokens to go)
    assert value(after, "lmsp_sse_streams_open") < value(during, "lmsp_sse_streams_open")
    requests = dict(endpoint="lmsp/v1/responses", method="POST", status="200")
    assert value(after, "lmsp_http_requests_total", **requests) >= (
        value(before, "lmsp_http_requests_total", **requests) + 1
    )
    # the scrapes count themselves too
    scrapes = dict(endpoint="metrics", method="GET", status="200")
    assert value(after, "lmsp_http_requests_total", **scrapes) >= 2
    tokens = value(after, "lmsp_output_tokens_total", model=MODEL) - value(
        before, "lmsp_output_tokens_total", model=MODEL
    )
    assert tokens >= usage["output_tokens"] > 0
    ttft = "lmsp_time_to_first_token_seconds_count"
    assert value(after, ttft, model=MODEL) >= value(before, ttft, model=MODEL) + 1
    itl = "lmsp_inter_token_latency_seconds_count"
    assert value(after, itl, model=MODEL) >= (
        value(before, itl, model=MODEL) + usage["output_tokens"] - 1
    )
    inf = value(after, "lmsp_inter_token_latency_seconds_bucket", model=MODEL, le="+Inf")
    assert inf == value(after, itl, model=MODEL)
    assert value(after, "lmsp_time_to_first_token_seconds_sum", model=MODEL) > 0
    assert value(after, "lmsp_redis_up") == 1


def test_sweeper_success_is_recorded_and_a_never_run_pruner_is_stale(stack, metrics_token):
    # beat runs the sweeper every second on the stack; the pruner every 300 s
    deadline = time.monotonic() + 60
    samples = scrape(stack, metrics_token)
    while not value(samples, "lmsp_job_last_success_timestamp_seconds", job=jobs.SWEEP):
        assert time.monotonic() < deadline, "no sweep recorded"
        time.sleep(0.5)
        samples = scrape(stack, metrics_token)
    assert value(samples, "lmsp_job_stale", job=jobs.SWEEP) == 0
    redis_client().hdel(recorders.JOBS_KEY, jobs.PRUNE)
    started = redis_client().get(recorders.JOBS_SCHEDULED_KEY)
    assert started is not None  # beat recorded its start
    # beat started a day ago: the pruner's first run, every 300 s, is long overdue
    redis_client().set(recorders.JOBS_SCHEDULED_KEY, repr(time.time() - 86_400))
    try:
        samples = scrape(stack, metrics_token)
    finally:
        redis_client().set(recorders.JOBS_SCHEDULED_KEY, started)
    assert value(samples, "lmsp_job_stale", job=jobs.PRUNE) == 1
    assert ("lmsp_job_last_success_timestamp_seconds", (("job", jobs.PRUNE),)) not in samples


def test_a_job_never_run_is_stale_only_once_its_first_run_is_overdue(admin_client, stack):
    """A job's first run is due an interval after beat starts: right after a
    start (an ops worker started afresh, no schedule kept) the pruner, every
    300 s, has not run and is not stale; the same never-run pruner is stale
    once beat's start is further back than three intervals and a margin."""
    redis_client().hdel(recorders.JOBS_KEY, jobs.PRUNE)
    stack.ops.stop()
    for kept in LOGS.glob(f"beat-{stack.port}*"):  # beat's schedule: a fresh start
        kept.unlink()
    restarted = time.time()
    stack.ops.start()
    deadline = time.monotonic() + 60
    while True:  # beat ticks: it runs the sweeper every second
        sweep = next(h for h in jobs.job_health() if h.job == jobs.SWEEP)
        if sweep.last_success is not None and sweep.last_success > restarted:
            break
        assert time.monotonic() < deadline, "no sweep after the restart"
        time.sleep(0.5)
    prune = next(h for h in jobs.job_health() if h.job == jobs.PRUNE)
    assert (prune.last_success, prune.stale) == (None, False)
    page = admin_client.get("/admin/lmsp/dashboard/").content.decode()
    row = page[page.index(f'data-job="{jobs.PRUNE}"') :]
    assert "never" in row[: row.index("</tr>")] and "stale" not in row[: row.index("</tr>")]
    started = float(redis_client().get(recorders.JOBS_SCHEDULED_KEY) or 0)
    assert started >= restarted  # beat recorded this start
    due = started + jobs.stale_after(jobs.intervals()[jobs.PRUNE]) + 1
    prune = next(h for h in jobs.job_health(now=due) if h.job == jobs.PRUNE)
    assert (prune.last_success, prune.stale) == (None, True)


def test_dashboard_shows_job_health_and_flags_a_stale_job(admin_client, stack):
    redis_client().hset(recorders.JOBS_KEY, jobs.SWEEP, repr(time.time()))
    redis_client().hset(recorders.JOBS_KEY, jobs.PRUNE, repr(time.time() - 86_400))
    html = admin_client.get("/admin/lmsp/dashboard/").content.decode()
    section = html[html.index('id="jobs"') : html.index('id="requests"')]
    sweep = section[section.index(f'data-job="{jobs.SWEEP}"') :]
    assert "</tr>" in sweep and "ok" in sweep[: sweep.index("</tr>")]
    prune = section[section.index(f'data-job="{jobs.PRUNE}"') :]
    assert "stale" in prune[: prune.index("</tr>")]
    assert " s ago" in prune[: prune.index("</tr>")]
