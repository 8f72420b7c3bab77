from collections.abc import Sequence
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from lmsp_core.status import FINAL_STATUSES, Status


class TaskKind(models.TextChoices):
    # Created with POST /tasks: listed, resumable, kept until task retention.
    TASK = "task"
    # The job behind a direct POST /responses: same machinery, never listed.
    DIRECT = "direct"


class Task(models.Model):
    """One generation job and its lifecycle.

    Every response is generated through a task; ``kind`` says whether the
    client asked for one. ``attempt`` fences the worker that owns the job:
    each write of a worker names the attempt it was given, so a worker that
    was presumed dead can no longer write (see ``tasks_app.claims``).
    """

    id = models.CharField(primary_key=True, max_length=40, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tasks"
    )
    kind = models.CharField(max_length=10, choices=TaskKind.choices, default=TaskKind.TASK)
    # The token that submitted it (empty: submitted without one, or before
    # 0009): the task runs only while it is usable (``tasks_app.entitlement``).
    # No constraint, so that a deleted token leaves its id, which then names
    # no token and lets nothing run.
    token = models.ForeignKey(
        "accounts_app.ApiToken",
        null=True,
        blank=True,
        on_delete=models.DO_NOTHING,
        db_constraint=False,
        related_name="+",
    )
    response = models.OneToOneField(
        "responses_app.Response", on_delete=models.CASCADE, related_name="task"
    )
    model = models.CharField(max_length=100, db_index=True)
    status = models.CharField(
        max_length=20, choices=Status.choices, default=Status.QUEUED, db_index=True
    )
    error = models.JSONField(null=True, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    enqueued_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True, db_index=True)

    # Ownership of the running job.
    attempt = models.PositiveIntegerField(default=0)
    # Attempts whose worker handed the task back (preempted for memory,
    # drained): not lost, so not counted against LMSP_MAX_ATTEMPTS.
    handed_back = models.PositiveIntegerField(default=0)
    worker = models.CharField(max_length=200, blank=True)
    lease_expires_at = models.DateTimeField(null=True, blank=True, db_index=True)
    cancel_requested = models.BooleanField(default=False)
    # Why it waits, and since when: its upstream server could not take it
    # (``upstream_waits``); cleared once the server answers again.
    waiting_reason = models.TextField(blank=True)
    waiting_since = models.DateTimeField(null=True, blank=True)

    # The event log: ids 1..last_event_id were written, 1..pruned_through removed.
    last_event_id = models.PositiveIntegerField(default=0)
    pruned_through = models.PositiveIntegerField(default=0)
    # Where generation stands, written with each flush of events so that a new
    # attempt continues exactly where the log ends (see generation.output).
    checkpoint = models.JSONField(null=True, blank=True)

    # Fair sharing (see tasks_app.fairness): the queue of a model is served in
    # the order of fair_key, the owner's virtual start time when it was
    # submitted; cost is what the task is charged, its output token budget.
    fair_key = models.BigIntegerField(default=0)
    cost = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["owner", "kind", "-id"], name="task_owner_list"),
            models.Index(fields=["model", "status", "fair_key", "created_at"], name="task_fair"),
        ]

    # Not stored: what the code that made or found this instance knows of it.
    # The events its submit wrote (``services.start_task``), which its first
    # follower in this process need not read back (``streams``).
    events_at_creation: Sequence[Any] = ()
    # Found under an idempotency key, not started by this request (``idempotency``).
    replayed: bool = False
    # What its owner's budgets have left, as its answer's header says (``budgets``).
    budget_remaining: str = ""

    def __str__(self) -> str:
        return self.id

    @property
    def is_final(self) -> bool:
        return self.status in FINAL_STATUSES

    @property
    def first_available_event_id(self) -> int | None:
        if self.pruned_through >= self.last_event_id and self.pruned_through > 0:
            return None
        return self.pruned_through + 1


class Event(models.Model):
    """One server-sent event of a task, numbered from 1 without gaps."""

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="events")
    seq = models.PositiveIntegerField()
    type = models.CharField(max_length=60)
    # The data line exactly as sent: compact JSON text, so replays are byte-identical.
    data = models.TextField()
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["task", "seq"]
        constraints = [models.UniqueConstraint(fields=["task", "seq"], name="event_task_seq")]

    def __str__(self) -> str:
        return f"{self.task_id}#{self.seq} {self.type}"


class TokenChunk(models.Model):
    """Token ids a running task generated, one row per flush.

    Appended, never rewritten, so that a flush costs the same at any length
    of the answer; gone once the task ends (the answer is in its response).
    """

    task = models.ForeignKey(Task, on_delete=models.CASCADE, related_name="token_chunks")
    start = models.PositiveIntegerField()  # position of the first id in the output
    token_ids = models.JSONField()

    class Meta:
        ordering = ["task", "start"]
        constraints = [
            models.UniqueConstraint(fields=["task", "start"], name="token_chunk_task_start")
        ]

    def __str__(self) -> str:
        return f"{self.task_id}@{self.start}"


class IdempotencyKey(models.Model):
    """An ``Idempotency-Key`` an owner sent, and the task its request started.

    ``task`` is empty while the first request is still being accepted; a
    retry in that window is told 409, and one with another body 422.
    """

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="idempotency_keys"
    )
    key = models.CharField(max_length=255)
    fingerprint = models.CharField(max_length=64)
    task = models.ForeignKey(Task, null=True, blank=True, on_delete=models.CASCADE)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "key"], name="idempotency_owner_key")
        ]

    def __str__(self) -> str:
        return f"{self.owner_id}:{self.key}"


class UsageRecord(models.Model):
    """Accounting for one request: written when it is accepted, completed when it
    ends, and kept after its response is gone (``store: false`` responses are
    deleted once delivered), so the admin's dashboard counts every request."""

    response_id = models.CharField(max_length=40, unique=True)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="usage_records"
    )
    model = models.CharField(max_length=100, db_index=True)
    kind = models.CharField(max_length=10, choices=TaskKind.choices)
    status = models.CharField(max_length=20, choices=Status.choices)
    input_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    # Prompt tokens the worker took from its prefix cache (a part of input_tokens).
    cached_tokens = models.PositiveIntegerField(default=0)
    # Time the request held a worker's engine: from its start to its end.
    worker_seconds = models.FloatField(default=0)
    created_at = models.DateTimeField(db_index=True)
    completed_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.response_id} {self.status}"


class DailyUsage(models.Model):
    """What one owner used of one model on one UTC day (the day a request was
    accepted): the sums of its usage records, kept beyond event and task
    retention, for budgets, the usage pages and finance. A request is added
    to its row, all its figures at once, in the transaction that ends it."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="daily_usage"
    )
    model = models.CharField(max_length=100)
    day = models.DateField()
    requests = models.PositiveIntegerField(default=0)
    input_tokens = models.PositiveBigIntegerField(default=0)
    output_tokens = models.PositiveBigIntegerField(default=0)
    cached_tokens = models.PositiveBigIntegerField(default=0)
    worker_seconds = models.FloatField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["owner", "model", "day"], name="one_usage_row_a_day")
        ]
        indexes = [models.Index(fields=["day", "model"])]
        verbose_name_plural = "daily usage"

    def __str__(self) -> str:
        return f"{self.owner} {self.model} {self.day}"


class OwnerQuota(models.Model):
    """An owner's quotas (empty: the ``LMSP_QUOTA_*`` default) and the row that
    serializes the owner's submits: ``tasks_app.quotas`` locks it for the
    length of a submit transaction, so two requests at once cannot both take
    the owner's last slot. Created on an owner's first submit."""

    owner = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="quota"
    )
    max_running = models.PositiveIntegerField(
        null=True, blank=True, help_text="Generations at once. Empty: LMSP_QUOTA_MAX_RUNNING."
    )
    max_queued = models.PositiveIntegerField(
        null=True, blank=True, help_text="Tasks waiting at once. Empty: LMSP_QUOTA_MAX_QUEUED."
    )
    output_tokens_per_minute = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="Output tokens in any 60 s. Empty: LMSP_QUOTA_OUTPUT_TOKENS_PER_MINUTE.",
    )
    allowed_models = models.JSONField(
        null=True,
        blank=True,
        help_text="Ids of the models this owner may use. Empty: every model.",
    )
    input_tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Input tokens a UTC day. Empty: no budget."
    )
    output_tokens_per_day = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Output tokens a UTC day. Empty: no budget."
    )
    input_tokens_per_month = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Input tokens a UTC calendar month. Empty: no budget."
    )
    output_tokens_per_month = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Output tokens a UTC calendar month. Empty: no budget."
    )

    def __str__(self) -> str:
        return f"quota of {self.owner}"


class ModelClock(models.Model):
    """The fair queue's virtual time for one model (start-time fair queueing):
    the fair key of the last task claimed. Claims lock this row, so the
    choice of the fairest task of a model is made by one claim at a time."""

    model = models.CharField(primary_key=True, max_length=100)
    virtual_time = models.BigIntegerField(default=0)

    def __str__(self) -> str:
        return f"{self.model}@{self.virtual_time}"


class QueuePosition(models.Model):
    """The lowest queue position reported for a task in its current stay in the
    queue: positions never go up (see ``tasks_app.fairness``). A row of its
    own, so that a client asking where its task stands never locks the task
    row a claim wants."""

    task = models.OneToOneField(
        Task, primary_key=True, on_delete=models.CASCADE, related_name="reported_position"
    )
    reported = models.PositiveIntegerField()

    def __str__(self) -> str:
        return f"{self.task_id}: {self.reported}"
