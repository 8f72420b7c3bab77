"""The Prometheus collector behind ``/metrics``: reads Redis and PostgreSQL on
each scrape, so that every web process answers with the whole service's
numbers (workers on other machines included), not its own.

Counters and histograms come from what ``recorders`` added up in Redis;
queue depth from the tasks table; each owner's use of each model from its
daily usage rows and its tasks in flight (``tasks_app.owner_usage``); live
workers from their heartbeats; job health from ``jobs``. A part that cannot
be read (Redis down) is left out of the scrape and ``lmsp_redis_up`` says so.

Who scrapes decides what is in it (``Audience``): an operator sees every
model and, unless ``LMSP_METRICS_OWNER_LABEL`` is off, each owner's series;
anyone else sees no owner at all (usage added up per model) and only the
models their token may use, so that a token cannot learn another owner's
name or use, or a model it may not see.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import redis
from django.conf import settings
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from generation.registry import available_models, declared_models
from tasks_app import heartbeat, owner_usage

from . import dashboard, jobs, recorders, upstream_health

log = logging.getLogger(__name__)

HISTOGRAMS = {
    recorders.TTFT: (
        "lmsp_time_to_first_token_seconds",
        "From the request's arrival to the first generated token (queue wait included).",
    ),
    recorders.INTER_TOKEN: (
        "lmsp_inter_token_latency_seconds",
        "Between two consecutive generated tokens of one generation.",
    ),
}


# The gauges of the workers' beats (``workers.tasks.EngineReport``) ...
ENGINE_GAUGES = {
    "token_budget": (
        "lmsp_kv_budget_tokens",
        "Tokens of keys and values the live workers' engines may hold "
        "(models.toml, or their GPU's memory).",
    ),
    "tokens_in_use": (
        "lmsp_kv_tokens_in_use",
        "Tokens of the budget in use: the running requests' (their prompts whole) "
        "and the prefix cache's.",
    ),
    "cache_tokens": ("lmsp_prefix_cache_tokens", "Tokens kept in the prefix caches."),
    "cache_entries": ("lmsp_prefix_cache_entries", "Token sequences kept in the prefix caches."),
}
# ... and their counts (``recorders.ENGINE_COUNTS``).
ENGINE_COUNTERS = {
    "prompt_tokens_computed": (
        "lmsp_prompt_tokens_computed",
        "Prompt tokens the engines computed (those taken from the prefix cache not included).",
    ),
    "prefix_hits": ("lmsp_prefix_cache_hits", "Prompts that started with a cached prefix."),
    "prefix_tokens_reused": (
        "lmsp_prefix_cache_tokens_saved",
        "Prompt tokens taken from the prefix cache instead of computed.",
    ),
    "preemptions": (
        "lmsp_preemptions",
        "Generations handed back to the queue because their engine needed the memory.",
    ),
}


# Per owner and model, of the requests that ended (``tasks_app.owner_usage``).
USAGE_COUNTERS = {
    "requests": "Requests that ended.",
    "input_tokens": "Input (prompt) tokens of the requests that ended.",
    "output_tokens": "Output tokens of the requests that ended.",
    "cached_tokens": "Input tokens taken from a prefix cache, of the requests that ended.",
    "worker_seconds": "Seconds the requests that ended held a worker's engine.",
}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True)
class Audience:
    """Who a scrape is for: whether its series name owners, and the models it
    shows (None: every one)."""

    by_owner: bool
    models: frozenset[str] | None

    def shows(self, model: str) -> bool:
        return self.models is None or model in self.models


OPERATOR = Audience(by_owner=True, models=None)


class LmspCollector(Collector):
    def __init__(self, audience: Audience = OPERATOR) -> None:
        self._audience = audience

    def collect(self) -> Iterator[Metric]:
        yield from self._database()
        try:
            families = list(self._redis())
            up = 1
        except redis.RedisError as exc:
            log.warning("metrics from Redis left out: %s", exc)
            families, up = [], 0
        yield from families
        redis_up = GaugeMetricFamily("lmsp_redis_up", "Whether this scrape could read Redis.")
        redis_up.add_metric([], up)
        yield redis_up

    def _database(self) -> Iterator[Metric]:
        yield from self._owners()
        queued = GaugeMetricFamily(
            "lmsp_generations_queued", "Tasks waiting for a model worker.", labels=["model"]
        )
        running = GaugeMetricFamily(
            "lmsp_generations_running", "Tasks being generated now.", labels=["model"]
        )
        for model, depth in dashboard.queue_depth().items():
            if not self._audience.shows(model):
                continue
            queued.add_metric([model], depth["queued"])
            running.add_metric([model], depth["in_progress"])
        yield queued
        yield running

    def _owners(self) -> Iterator[Metric]:
        """Requests and tokens per owner and model (``tasks_app.owner_usage``);
        without the owner label when ``LMSP_METRICS_OWNER_LABEL`` is off or
        the scrape is not an operator's."""
        by_owner = settings.LMSP_METRICS_OWNER_LABEL and self._audience.by_owner
        shows = self._audience.shows
        labels = ["owner", "model"] if by_owner else ["model"]

        def of(owner: str, model: str) -> list[str]:
            return [owner, model] if by_owner else [model]

        counters = {
            name: CounterMetricFamily(f"lmsp_usage_{name}", documentation, labels=labels)
            for name, documentation in USAGE_COUNTERS.items()
        }
        for usage in filter(lambda usage: shows(usage.model), owner_usage.ended(by_owner)):
            for name, counter in counters.items():
                counter.add_metric(of(usage.owner, usage.model), getattr(usage, name))
        yield from counters.values()
        in_flight = GaugeMetricFamily(
            "lmsp_usage_requests_in_flight",
            "Requests queued or being generated now.",
            labels=labels,
        )
        for owner, model, count in owner_usage.in_flight(by_owner):
            if not shows(model):
                continue
            in_flight.add_metric(of(owner, model), count)
        yield in_flight

    def _redis(self) -> Iterator[Metric]:
        client = recorders.client()
        requests = CounterMetricFamily(
            "lmsp_http_requests",
            "HTTP answers by endpoint (URL pattern), method and status.",
            labels=["endpoint", "method", "status"],
        )
        for field, count in sorted(client.hgetall(recorders.REQUESTS_KEY).items()):
            labels = _text(field).split(recorders.FIELD_SEPARATOR)
            if len(labels) == 3:
                requests.add_metric(labels, int(count))
        yield requests

        tokens = CounterMetricFamily(
            "lmsp_output_tokens", "Tokens generated, end-of-turn tokens included.", labels=["model"]
        )
        for model, count in sorted(client.hgetall(recorders.OUTPUT_TOKENS_KEY).items()):
            if self._audience.shows(_text(model)):
                tokens.add_metric([_text(model)], int(count))
        yield tokens

        for name, (metric, documentation) in HISTOGRAMS.items():
            yield self._histogram(client, name, metric, documentation)

        streams = GaugeMetricFamily(
            "lmsp_sse_streams_open", "Server-sent event streams open now, all web processes."
        )
        total = 0
        keys = list(client.scan_iter(match=recorders.STREAMS_PREFIX + "*", count=500))
        for value in client.mget(keys) if keys else []:
            total += max(int(value or 0), 0)
        streams.add_metric([], total)
        yield streams

        workers = GaugeMetricFamily(
            "lmsp_workers_alive", "Model workers serving the model (heartbeats).", labels=["model"]
        )
        served = heartbeat.serving_workers()
        models = sorted(filter(self._audience.shows, set(available_models()) | set(served)))
        for model in models:
            workers.add_metric([model], len(served.get(model, [])))
        yield workers
        yield from self._engines(client, models, served)
        yield from self._upstreams()

        last = GaugeMetricFamily(
            "lmsp_job_last_success_timestamp_seconds",
            "When the periodic job last ran to its end (Unix time).",
            labels=["job"],
        )
        stale = GaugeMetricFamily(
            "lmsp_job_stale",
            "1 when the periodic job has not succeeded for several intervals "
            "(a job never run: since beat started).",
            labels=["job"],
        )
        for health in jobs.job_health():
            if health.last_success is not None:
                last.add_metric([health.job], health.last_success)
            stale.add_metric([health.job], 1 if health.stale else 0)
        yield last
        yield stale

    def _upstreams(self) -> Iterator[Metric]:
        """Each upstream model's server as its workers last found it."""
        models = sorted(
            model
            for model, spec in declared_models().items()
            if spec.upstream is not None and self._audience.shows(model)
        )
        up = GaugeMetricFamily(
            "lmsp_upstream_up",
            "1 when the model's upstream server answered its worker's last probe or request.",
            labels=["model"],
        )
        checked = GaugeMetricFamily(
            "lmsp_upstream_checked_timestamp_seconds",
            "When a worker last probed the model's upstream server (Unix time).",
            labels=["model"],
        )
        since = GaugeMetricFamily(
            "lmsp_upstream_since_timestamp_seconds",
            "Since when the upstream server has been up, or down (Unix time).",
            labels=["model"],
        )
        for model, health in sorted(upstream_health.read(models).items()):
            up.add_metric([model], 1 if health.reachable else 0)
            checked.add_metric([model], health.checked_at)
            since.add_metric([model], health.since)
        yield up
        yield checked
        yield since

    def _engines(
        self, client: redis.Redis, models: list[str], served: dict[str, list[heartbeat.Beat]]
    ) -> Iterator[Metric]:
        """What the live workers' engines hold (their last beats, added up) and
        what they counted."""
        for name, (metric, documentation) in ENGINE_GAUGES.items():
            gauge = GaugeMetricFamily(metric, documentation, labels=["model"])
            for model in models:
                beats = served.get(model, [])
                gauge.add_metric([model], sum(beat.engine.get(name, 0) for beat in beats))
            yield gauge
        counted: dict[tuple[str, str], int] = {}
        for field, count in client.hgetall(recorders.ENGINE_COUNTS_KEY).items():
            labels = _text(field).split(recorders.FIELD_SEPARATOR)
            if len(labels) == 2:
                counted[(labels[0], labels[1])] = int(count)
        for name, (metric, documentation) in ENGINE_COUNTERS.items():
            counter = CounterMetricFamily(metric, documentation, labels=["model"])
            for model in models:
                counter.add_metric([model], counted.get((model, name), 0))
            yield counter

    def _histogram(
        self, client: redis.Redis, name: str, metric: str, documentation: str
    ) -> HistogramMetricFamily:
        family = HistogramMetricFamily(metric, documentation, labels=["model"])
        bounds = [recorders.bucket_field(upper) for upper in recorders.BUCKETS[name]]
        pattern = recorders.histogram_key(name, "*")
        for key in sorted(client.scan_iter(match=pattern, count=500)):
            model = _text(key).removeprefix(recorders.histogram_key(name, ""))
            if not self._audience.shows(model):
                continue
            raw = {_text(k): v for k, v in client.hgetall(key).items()}
            cumulative, buckets = 0, []
            for bound in bounds:
                cumulative += int(raw.get(bound, 0))
                buckets.append((bound, cumulative))
            cumulative += int(raw.get("+Inf", 0))
            buckets.append(("+Inf", cumulative))
            total = float(raw.get("sum", 0.0))
            family.add_metric([model], buckets, sum_value=total if math.isfinite(total) else 0.0)
        return family
