"""The Celery app of ``celery -A lmsp_project``: the kernel's, with the jobs of the
worker and of the operators."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

from lmsp_core.celery_app import app  # noqa: E402 - the settings module is named first

app.autodiscover_tasks(["workers", "ops_app"])

__all__ = ["app"]
