"""Settings, all read from the environment (see README, "Configuration")."""

import os
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

from . import localservices
from .env import (
    check_secret_key,
    database_from_url,
    env_bool,
    env_float,
    env_int,
    env_list,
    trusted_proxies,
)

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("LMSP_DATA_DIR", BASE_DIR / ".data"))
# Unset DATABASE_URL / REDIS_URL: the embedded services of a running
# scripts/serve of this checkout, as it recorded them in the data folder.
_RUNNING = (
    {}
    if os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")
    else localservices.recorded(DATA_DIR)
)

BUILTIN_SECRET_KEY = "dev-only-insecure-key-change-me"
SECRET_KEY = os.environ.get("LMSP_SECRET_KEY", BUILTIN_SECRET_KEY)
DEBUG = env_bool("LMSP_DEBUG", False)
# A development run may use the built-in key; anything else must bring its own
# (sessions, admin, CSRF). Only LMSP_DEVELOPMENT=1 says a run is one: set by
# scripts/serve, scripts/test, manage.py on the embedded PostgreSQL, and
# recorded by scripts/serve for the commands that join its embedded services.
# (A missing DATABASE_URL once counted too, and a server with a PostgreSQL on
# the default address then ran with the key everyone knows; so did LMSP_DEBUG=1.)
LMSP_DEVELOPMENT = env_bool("LMSP_DEVELOPMENT", False) or (
    not os.environ.get("DATABASE_URL") and _RUNNING.get("LMSP_DEVELOPMENT") == "1"
)
check_secret_key(SECRET_KEY, BUILTIN_SECRET_KEY, development=LMSP_DEVELOPMENT)
ALLOWED_HOSTS = env_list("LMSP_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver")

# --- behind a proxy that terminates TLS (README, "Operations") ----------------
# Origins (scheme://host[:port]) whose forms the admin accepts besides its own
# host's, such as the public https:// address of a proxy that forwards
# another Host header.
CSRF_TRUSTED_ORIGINS = env_list("LMSP_CSRF_TRUSTED_ORIGINS")
# A proxy in front terminates TLS and sets X-Forwarded-Proto on every request
# (overwriting any the client sent): a request it marks https is secure, so
# that the admin's CSRF check expects https:// origins, and the session and
# CSRF cookies are sent over https only. Forwarded headers count only on
# requests from LMSP_TRUSTED_PROXIES (addresses or networks, comma separated;
# none by default): from anyone else they are dropped
# (lmsp_core.forwarded), so that no client can claim https.
LMSP_BEHIND_TLS_PROXY = env_bool("LMSP_BEHIND_TLS_PROXY", False)
LMSP_TRUSTED_PROXIES = trusted_proxies("LMSP_TRUSTED_PROXIES")
if LMSP_BEHIND_TLS_PROXY:
    if not LMSP_TRUSTED_PROXIES:
        raise ImproperlyConfigured(
            "LMSP_BEHIND_TLS_PROXY=1 needs LMSP_TRUSTED_PROXIES: the proxy's addresses or "
            "networks (comma separated), the only ones whose X-Forwarded-Proto counts."
        )
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SESSION_COOKIE_SECURE = CSRF_COOKIE_SECURE = True
# Strict-Transport-Security on secure answers: browsers then use https only
# for this long (seconds; 0: no header). Raise it once https works for good.
SECURE_HSTS_SECONDS = env_int("LMSP_HSTS_SECONDS", 0)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "accounts_app",
    "responses_app",
    "tasks_app",
    "workers",
    "openai_app",
    "ops_app",
    "playground_app",
]

MIDDLEWARE = [
    # Before anything reads the scheme or the host: forwarded headers of
    # anyone but a trusted proxy dropped.
    "lmsp_core.forwarded.TrustedProxyMiddleware",
    # Outermost but that: counts the answer as the client gets it (for /metrics).
    "ops_app.middleware.request_metrics",
    "lmsp_core.middleware.ProtocolMiddleware",
    "openai_app.middleware.OpenAIErrorMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "lmsp_core.middleware.NulRefusalMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "lmsp_project.urls"
ASGI_APPLICATION = "lmsp_project.asgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

# Connections per process in psycopg's pool (Django's "pool" option): a
# request, an async view's db_call or a job borrows one and hands it back
# instead of starting a PostgreSQL session each time. A model worker holds
# two per generation it runs (its job thread and its lease thread), so the
# default covers a batch of 8 with room. 0: one new session per request,
# closed after it. A connection that died with a PostgreSQL restart is
# replaced when borrowed (lmsp_project.env). Stream reads have their own
# pool (tasks_app.event_reader).
LMSP_DB_POOL_SIZE = env_int("LMSP_DB_POOL_SIZE", 20)
DATABASES = {
    "default": database_from_url(
        os.environ.get("DATABASE_URL")
        or _RUNNING.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/lmsp"),
        pool_size=LMSP_DB_POOL_SIZE,
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL") or _RUNNING.get("REDIS_URL", "redis://127.0.0.1:6379/0")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

# Request bodies above this are answered 413 payload_too_large.
LMSP_MAX_BODY_BYTES = env_int("LMSP_MAX_BODY_BYTES", 1_000_000)
DATA_UPLOAD_MAX_MEMORY_SIZE = LMSP_MAX_BODY_BYTES
# The whole body must have arrived this long after the request's headers;
# a slower upload is answered 408 request_timeout (lmsp_core.asgi).
LMSP_BODY_TIMEOUT_SECONDS = env_float("LMSP_BODY_TIMEOUT_SECONDS", 30.0)

# --- request limits (lmsp_core.jsonbody, responses_app.serializers) -----------
# Arrays and objects in a request body nest at most this deep.
LMSP_MAX_JSON_DEPTH = env_int("LMSP_MAX_JSON_DEPTH", 64)
# Items in a request's input, and content parts (or summary parts) in one item.
LMSP_MAX_INPUT_ITEMS = env_int("LMSP_MAX_INPUT_ITEMS", 1000)
LMSP_MAX_CONTENT_PARTS = env_int("LMSP_MAX_CONTENT_PARTS", 100)
LMSP_MAX_TOOLS = env_int("LMSP_MAX_TOOLS", 128)
# One JSON Schema (a tool's parameters, a json_schema answer): its size as
# compact JSON, its nesting depth as a JSON document, and the most times a
# regular expression in it ("pattern") may repeat something, nested
# repetitions multiplied. Compiling a grammar grows fast with the last two.
LMSP_MAX_SCHEMA_BYTES = env_int("LMSP_MAX_SCHEMA_BYTES", 65_536)
LMSP_MAX_SCHEMA_DEPTH = env_int("LMSP_MAX_SCHEMA_DEPTH", 32)
LMSP_MAX_PATTERN_REPEAT = env_int("LMSP_MAX_PATTERN_REPEAT", 1000)

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["accounts_app.authentication.BearerTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["accounts_app.authentication.HasRequiredScope"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["lmsp_core.jsonbody.StrictJSONParser"],
    "EXCEPTION_HANDLER": "lmsp_core.errors.drf_exception_handler",
    "UNAUTHENTICATED_USER": None,
}

# --- models -----------------------------------------------------------------
LMSP_MODELS_FILE = Path(os.environ.get("LMSP_MODELS_FILE", BASE_DIR / "models.toml"))
LMSP_MODEL_CACHE = Path(os.environ.get("LMSP_MODEL_CACHE", DATA_DIR / "models"))
# Model queues are named PREFIX.<model>; installations sharing one Redis
# keep their jobs apart with different prefixes.
LMSP_QUEUE_PREFIX = os.environ.get("LMSP_QUEUE_PREFIX", "lmsp.model")
# The models this worker process serves (comma separated ids); empty = all.
LMSP_WORKER_MODELS = os.environ.get("LMSP_WORKER_MODELS", "")

# --- generation, tasks and streams -------------------------------------------
# How often a worker writes its buffered events (one transaction per flush;
# the first event at once). Each flush costs CPU beside the decoding (the
# transaction, the publish, the web's stream writes): on 2 CPU cores a
# lone request ran at 0.93-0.96x raw generation with 0.05 s, 0.99x with
# 0.15 s (bench/README.md). Cancels do not wait for it (workers.cancellation).
LMSP_FLUSH_INTERVAL_SECONDS = env_float("LMSP_FLUSH_INTERVAL_SECONDS", 0.15)
# A running task's lease; the worker renews it on every flush.
LMSP_LEASE_SECONDS = env_float("LMSP_LEASE_SECONDS", 30.0)
LMSP_MAX_ATTEMPTS = env_int("LMSP_MAX_ATTEMPTS", 3)
# A task still queued this long after it was sent is sent again (lost message).
LMSP_REQUEUE_AFTER_SECONDS = env_float("LMSP_REQUEUE_AFTER_SECONDS", 60.0)
LMSP_SWEEP_INTERVAL_SECONDS = env_float("LMSP_SWEEP_INTERVAL_SECONDS", 5.0)
LMSP_KEEPALIVE_SECONDS = env_float("LMSP_KEEPALIVE_SECONDS", 15.0)
# Event streams (tasks_app.streams): each web process keeps one feed per followed
# task. While its Redis subscription is down, a feed reads the database this often;
LMSP_STREAM_POLL_SECONDS = env_float("LMSP_STREAM_POLL_SECONDS", 1.0)
# while it is up, each web process checks the tasks of all its feeds this often
# (one query per process, not per feed or follower) in case a message was lost.
LMSP_STREAM_CHECK_SECONDS = env_float("LMSP_STREAM_CHECK_SECONDS", 15.0)
# Recent events a feed keeps as frames; a follower further back replays from
# the database in pages of LMSP_STREAM_PAGE_EVENTS.
LMSP_STREAM_WINDOW_EVENTS = env_int("LMSP_STREAM_WINDOW_EVENTS", 2048)
LMSP_STREAM_PAGE_EVENTS = env_int("LMSP_STREAM_PAGE_EVENTS", 500)
# Open event streams one web process serves, in all, per token and per owner
# (all its tokens); beyond any, a new stream is answered 503 overloaded with
# Retry-After. Streams that follow a task (GET /lmsp/v1/tasks/{id}/events,
# GET /v1/responses/{id}?stream=true) count, and so do replays of idempotent
# direct responses; a direct response's own answer does not (the model's
# queue and the owner's quotas bound those).
LMSP_MAX_STREAMS_PER_PROCESS = env_int("LMSP_MAX_STREAMS_PER_PROCESS", 20_000)
LMSP_MAX_STREAMS_PER_TOKEN = env_int("LMSP_MAX_STREAMS_PER_TOKEN", 1_000)
LMSP_MAX_STREAMS_PER_OWNER = env_int("LMSP_MAX_STREAMS_PER_OWNER", 2_000)
LMSP_STREAM_RETRY_AFTER_SECONDS = env_int("LMSP_STREAM_RETRY_AFTER_SECONDS", 5)
# A revoked token's streams end at once (a message on Redis); without one (a lost
# message, an expiry) each web process checks its streams' tokens this often.
LMSP_STREAM_ACCESS_CHECK_SECONDS = env_float("LMSP_STREAM_ACCESS_CHECK_SECONDS", 30.0)
# A signed stream URL (POST /lmsp/v1/tasks/{id}/stream-url, for a web page's
# EventSource) opens its task's stream for this many minutes after it was issued.
LMSP_STREAM_URL_MINUTES = env_float("LMSP_STREAM_URL_MINUTES", 10.0)
# A playground sign-in with the admin's session issues its user a bearer token
# that expires after this many minutes (playground_app).
LMSP_PLAYGROUND_TOKEN_MINUTES = env_int("LMSP_PLAYGROUND_TOKEN_MINUTES", 60)
# Event streams that follow a task (GET /lmsp/v1/tasks/{id}/events, GET
# /v1/responses/{id}) and direct responses (POST /lmsp/v1/responses, /v1/responses,
# /v1/chat/completions) are served outside Django's request handler
# (lmsp_core.lean): same answers, a fraction of the memory and CPU per stream, no
# thread hops before a generation is submitted.
LMSP_LEAN_STREAMS = env_bool("LMSP_LEAN_STREAMS", True)
# /metrics: the per-owner series carry an owner label (off: added up per model).
LMSP_METRICS_OWNER_LABEL = env_bool("LMSP_METRICS_OWNER_LABEL", True)
LMSP_EVENT_RETENTION_SECONDS = env_int("LMSP_EVENT_RETENTION_SECONDS", 86_400)
LMSP_TASK_RETENTION_SECONDS = env_int("LMSP_TASK_RETENTION_SECONDS", 30 * 86_400)
# Stored responses (store: true, the default of /v1/responses) are erased by the
# pruner this many days after they were created; 0 or empty: kept until deleted.
LMSP_RESPONSE_RETENTION_DAYS = env_float("LMSP_RESPONSE_RETENTION_DAYS", 0.0)
LMSP_PRUNE_INTERVAL_SECONDS = env_float("LMSP_PRUNE_INTERVAL_SECONDS", 300.0)
LMSP_IDEMPOTENCY_TTL_SECONDS = env_int("LMSP_IDEMPOTENCY_TTL_SECONDS", 86_400)
# A claimed key whose request started no task this long after is taken over
# by the next request with it (its first request died); above the longest
# acceptance, grammar check included.
LMSP_IDEMPOTENCY_TAKEOVER_SECONDS = env_float("LMSP_IDEMPOTENCY_TAKEOVER_SECONDS", 10.0)
# Compiling a request's grammar (web check and worker) runs in a child process
# with these limits; a schema beyond them is refused (400 invalid_request).
LMSP_GRAMMAR_TIMEOUT_SECONDS = env_float("LMSP_GRAMMAR_TIMEOUT_SECONDS", 5.0)
LMSP_GRAMMAR_MEMORY_MB = env_int("LMSP_GRAMMAR_MEMORY_MB", 1024)
# Compiles one web process runs at once (each a child of up to the memory
# above); a request finding them all taken waits up to this long for one,
# then is answered 503 overloaded. Keep the wait plus the timeout below
# LMSP_IDEMPOTENCY_TAKEOVER_SECONDS.
LMSP_GRAMMAR_CONCURRENCY = env_int("LMSP_GRAMMAR_CONCURRENCY", 2)
LMSP_GRAMMAR_WAIT_SECONDS = env_float("LMSP_GRAMMAR_WAIT_SECONDS", 3.0)
# Compiled grammars a worker keeps per model, and the bytes xgrammar's own
# compiler cache may hold.
LMSP_GRAMMAR_CACHE_ENTRIES = env_int("LMSP_GRAMMAR_CACHE_ENTRIES", 64)
LMSP_GRAMMAR_CACHE_MB = env_int("LMSP_GRAMMAR_CACHE_MB", 256)
# Queued tasks per model above which new work is refused with 503 overloaded.
LMSP_MAX_QUEUED_PER_MODEL = env_int("LMSP_MAX_QUEUED_PER_MODEL", 1000)
# Per-owner quotas (an owner's own values are set in the admin, on the user's
# page); 0 means no limit. Past one: 429 rate_limited (running: the owner's
# tasks wait their turn instead).
LMSP_QUOTA_MAX_RUNNING = env_int("LMSP_QUOTA_MAX_RUNNING", 0)
LMSP_QUOTA_MAX_QUEUED = env_int("LMSP_QUOTA_MAX_QUEUED", 200)
LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE = env_int("LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE", 0)
# Retry-After of a 429 for too many queued tasks.
LMSP_QUOTA_RETRY_AFTER_SECONDS = env_int("LMSP_QUOTA_RETRY_AFTER_SECONDS", 10)
# The longest a single generation may run; the broker's visibility timeout is
# set above it so that Redis never hands a running job to a second worker.
LMSP_MAX_JOB_SECONDS = env_int("LMSP_MAX_JOB_SECONDS", 6 * 3600)
# A model worker told to stop (SIGTERM) hands its generations back to the
# queue once another worker serves its models, or after this long (keep it
# below the supervisor's grace period: compose's stop_grace_period).
LMSP_DRAIN_WAIT_SECONDS = env_float("LMSP_DRAIN_WAIT_SECONDS", 10.0)

# --- Celery -----------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL
# kombu's Redis transport, kept alive across a Redis restart (see the module).
CELERY_BROKER_TRANSPORT = "lmsp_core.redis_transport:Transport"
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# Long GPU jobs: a message is acknowledged only once its job has ended, and a
# worker takes one message at a time, so a crash never loses a message that
# another worker could have run ("Long running tasks" in Celery's docs). Jobs
# are idempotent: a redelivered message for a task that is no longer queued
# is dropped (see tasks_app.claims.claim).
CELERY_TASK_ACKS_LATE = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# A killed child would otherwise be re-queued forever (Celery warns of loops);
# our own lease and sweeper decide whether a lost job runs again.
CELERY_TASK_REJECT_ON_WORKER_LOST = False
# Redis redelivers an unacknowledged message after the visibility timeout even
# while its first worker still runs it: keep it above the longest job.
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": LMSP_MAX_JOB_SECONDS + 3600}
# After a broker reconnect, a running job's message may be redelivered; stop
# the long-running job instead of letting two workers generate at once.
CELERY_WORKER_CANCEL_LONG_RUNNING_TASKS_ON_CONNECTION_LOSS = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_DEFAULT_QUEUE = "lmsp.control"
CELERY_BEAT_SCHEDULE = {
    "sweep-tasks": {
        "task": "ops_app.tasks.sweep_tasks",
        "schedule": LMSP_SWEEP_INTERVAL_SECONDS,
    },
    "prune-events": {
        "task": "ops_app.tasks.prune_events",
        "schedule": LMSP_PRUNE_INTERVAL_SECONDS,
    },
}
# Beat's last run times, in the data folder wherever LMSP_DATA_DIR puts it (the
# Procfile and compose leave --schedule out so that this applies).
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LMSP_LOG_LEVEL", "INFO")},
    # pgserver narrates every start and stop at INFO (manage.py runs start one).
    "loggers": {"httpx": {"level": "WARNING"}, "pgserver": {"level": "WARNING"}},
}

# Database connections shared by all event-stream readers of one web process.
LMSP_STREAM_DB_POOL_SIZE = env_int("LMSP_STREAM_DB_POOL_SIZE", 10)
