"""The one status vocabulary of a generation (contract section 6).

A task and the response it produces move through the same states, so one
enum serves both: a response is ``in_progress`` while its task is queued or
running, and both end with the same final status (the lifecycle moves a
response's status with its task's: ``tasks_app.transitions``).
"""

from django.db import models


class Status(models.TextChoices):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    CANCELLED = "cancelled"


FINAL_STATUSES = frozenset({Status.COMPLETED, Status.INCOMPLETE, Status.FAILED, Status.CANCELLED})
