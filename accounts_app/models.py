from datetime import datetime

from django.conf import settings
from django.db import models
from django.utils import timezone

SCOPES = (
    "models:read",
    "responses:write",
    "responses:read",
    "tasks:write",
    "tasks:read",
    # Scraping GET /metrics (Prometheus): counters, not protocol data; without
    # owners, and of the token's models only ...
    "metrics:read",
    # ... unless the token is an operator's: each owner's series, every model.
    "metrics:operator",
    # GET /lmsp/v1/usage: the owner's own use, by day or month and model.
    "usage:read",
)
# Reserved by the protocol for services that run tools; never granted here.
RESERVED_SCOPES = ("tools:execute",)


class ApiToken(models.Model):
    """A bearer token. Only a SHA-256 hash of the secret is kept."""

    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=100, blank=True)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, editable=False)
    scopes = models.JSONField(default=list)
    # Narrows the owner's models (tasks_app's OwnerQuota.allowed_models) further.
    allowed_models = models.JSONField(
        null=True,
        blank=True,
        help_text="Ids of the models this token may use, among its owner's. Empty: all of them.",
    )
    created_at = models.DateTimeField(default=timezone.now, editable=False)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True, editable=False)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API token"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.owner})"

    def is_active(self, now: datetime | None = None) -> bool:
        now = now or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > now
