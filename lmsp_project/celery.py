import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")

app = Celery("lmsp")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks(["workers"])
