"""Start a Celery worker for the models this machine serves.

    python -m workers.serve            # every available model
    LMSP_WORKER_MODELS=smollm2:135m python -m workers.serve

A model worker runs the solo pool: one generation at a time, in the process
that loaded the model (no fork after the weights are in memory).
"""

import os
import sys


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
    import django

    django.setup()
    from generation.registry import served_models
    from lmsp_project.celery import app

    queues = ",".join(spec.queue for spec in served_models())
    if not queues:
        sys.exit("No model to serve: none of models.toml's models is on this machine.")
    app.worker_main(
        [
            "worker",
            "--pool",
            "solo",
            "--queues",
            queues,
            "--hostname",
            f"models-{os.getpid()}@%h",
            "--loglevel",
            os.environ.get("LMSP_LOG_LEVEL", "INFO"),
            *sys.argv[1:],
        ]
    )


if __name__ == "__main__":
    main()
