"""Settings, all read from the environment (see README, "Configuration")."""

import os
from pathlib import Path

from .env import database_from_url, env_bool, env_float, env_int

BASE_DIR = Path(__file__).resolve().parent.parent
DATA_DIR = Path(os.environ.get("LMSP_DATA_DIR", BASE_DIR / ".data"))

SECRET_KEY = os.environ.get("LMSP_SECRET_KEY", "dev-only-insecure-key-change-me")
DEBUG = env_bool("LMSP_DEBUG", False)
ALLOWED_HOSTS = os.environ.get("LMSP_ALLOWED_HOSTS", "127.0.0.1,localhost,testserver").split(",")

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
]

MIDDLEWARE = [
    "lmsp_core.middleware.ProtocolMiddleware",
    "django.middleware.security.SecurityMiddleware",
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

DATABASES = {
    "default": database_from_url(
        os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/lmsp")
    )
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True
STATIC_URL = "static/"
STATIC_ROOT = DATA_DIR / "static"

# Request bodies above this are answered 413 payload_too_large.
LMSP_MAX_BODY_BYTES = env_int("LMSP_MAX_BODY_BYTES", 1_000_000)
DATA_UPLOAD_MAX_MEMORY_SIZE = LMSP_MAX_BODY_BYTES

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
# How often a worker writes its buffered events (one transaction per flush).
LMSP_FLUSH_INTERVAL_SECONDS = env_float("LMSP_FLUSH_INTERVAL_SECONDS", 0.05)
# A running task's lease; the worker renews it on every flush.
LMSP_LEASE_SECONDS = env_float("LMSP_LEASE_SECONDS", 30.0)
LMSP_MAX_ATTEMPTS = env_int("LMSP_MAX_ATTEMPTS", 3)
# A task still queued this long after it was sent is sent again (lost message).
LMSP_REQUEUE_AFTER_SECONDS = env_float("LMSP_REQUEUE_AFTER_SECONDS", 60.0)
LMSP_SWEEP_INTERVAL_SECONDS = env_float("LMSP_SWEEP_INTERVAL_SECONDS", 5.0)
LMSP_KEEPALIVE_SECONDS = env_float("LMSP_KEEPALIVE_SECONDS", 15.0)
# How long a stream reader waits on Redis before it looks at the database anyway.
LMSP_STREAM_POLL_SECONDS = env_float("LMSP_STREAM_POLL_SECONDS", 1.0)
LMSP_EVENT_RETENTION_SECONDS = env_int("LMSP_EVENT_RETENTION_SECONDS", 86_400)
LMSP_TASK_RETENTION_SECONDS = env_int("LMSP_TASK_RETENTION_SECONDS", 30 * 86_400)
LMSP_PRUNE_INTERVAL_SECONDS = env_float("LMSP_PRUNE_INTERVAL_SECONDS", 300.0)
LMSP_IDEMPOTENCY_TTL_SECONDS = env_int("LMSP_IDEMPOTENCY_TTL_SECONDS", 86_400)
# Queued tasks per model above which new work is refused with 503 overloaded.
LMSP_MAX_QUEUED_PER_MODEL = env_int("LMSP_MAX_QUEUED_PER_MODEL", 1000)
# Per-owner quotas (an owner's own values are set in the admin, on the user's
# page); 0 means no limit. Past one: 429 rate_limited (running: the owner's
# tasks wait their turn instead).
LMSP_QUOTA_MAX_RUNNING = env_int("LMSP_QUOTA_MAX_RUNNING", 4)
LMSP_QUOTA_MAX_QUEUED = env_int("LMSP_QUOTA_MAX_QUEUED", 200)
LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE = env_int("LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE", 0)
# Retry-After of a 429 for too many queued tasks.
LMSP_QUOTA_RETRY_AFTER_SECONDS = env_int("LMSP_QUOTA_RETRY_AFTER_SECONDS", 10)
# The longest a single generation may run; the broker's visibility timeout is
# set above it so that Redis never hands a running job to a second worker.
LMSP_MAX_JOB_SECONDS = env_int("LMSP_MAX_JOB_SECONDS", 6 * 3600)

# --- Celery -----------------------------------------------------------------
CELERY_BROKER_URL = REDIS_URL
CELERY_RESULT_BACKEND = None
CELERY_TASK_IGNORE_RESULT = True
# Long GPU jobs: a message is acknowledged only once its job has ended, and a
# worker takes one message at a time, so a crash never loses a message that
# another worker could have run ("Long running tasks" in Celery's docs). Jobs
# are idempotent: a redelivered message for a task that is no longer queued
# is dropped (see tasks_app.lifecycle.claim).
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
        "task": "workers.tasks.sweep_tasks",
        "schedule": LMSP_SWEEP_INTERVAL_SECONDS,
    },
    "prune-events": {
        "task": "workers.tasks.prune_events",
        "schedule": LMSP_PRUNE_INTERVAL_SECONDS,
    },
}
CELERY_BEAT_SCHEDULE_FILENAME = str(DATA_DIR / "celerybeat-schedule")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": os.environ.get("LMSP_LOG_LEVEL", "INFO")},
    "loggers": {"httpx": {"level": "WARNING"}},
}

# Database connections shared by all event-stream readers of one web process.
LMSP_STREAM_DB_POOL_SIZE = env_int("LMSP_STREAM_DB_POOL_SIZE", 10)
