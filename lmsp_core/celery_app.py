"""The Celery app every process sends jobs with and reads the broker through.

It lives in the kernel so that the layers below the composition root
(``tasks_app`` sends a task's job and reads its queues) take it from here
rather than from ``lmsp_project``, which imports every layer. Jobs are sent
by name (``workers.tasks``), so nothing here knows the worker's code; the
composition root (``lmsp_project/celery.py``, ``celery -A lmsp_project``)
adds the worker's jobs to this same app.
"""

from celery import Celery

app = Celery("lmsp")
app.config_from_object("django.conf:settings", namespace="CELERY")
