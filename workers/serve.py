"""Start a Celery worker for the models this machine serves.

    python -m workers.serve            # every available model
    LMSP_WORKER_MODELS=smollm2:135m python -m workers.serve

A model worker runs the threads pool in the process that loaded the model
(no fork after the weights are in memory): up to ``max_batch`` jobs per model
at once, decoded together by the model's batching engine.
"""

import os
import sys
import threading


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "lmsp_project.settings")
    import django

    django.setup()
    from generation import grammar_limits
    from generation.registry import served_models
    from lmsp_core.celery_app import app

    from .runner import worker_name

    served = served_models()
    if not served:
        sys.exit("No model to serve: none of models.toml's models is on this machine.")
    # Grammars compile in children of a fork server, whose start takes seconds
    # of a core: now, beside Celery's start and the model's load, so that it
    # is warm before the first job and never competes with a generation (a
    # successor taking over a draining worker's generations prefills them all
    # at once).
    threading.Thread(target=grammar_limits.warm, name="lmsp-grammar-warm", daemon=True).start()
    # One thread per generation the engines can hold at once: each job thread
    # claims a task, feeds it to its model's engine and writes its events.
    concurrency = sum(spec.max_batch for spec in served)
    app.worker_main(
        [
            "worker",
            "--pool",
            "threads",
            "--concurrency",
            str(concurrency),
            # Each model's queue, and this worker's own (jobs sent here for
            # what it has cached: ModelSpec.worker_queue).
            "--queues",
            ",".join(q for spec in served for q in (spec.queue, spec.worker_queue(worker_name()))),
            "--hostname",
            worker_name(),
            "--loglevel",
            os.environ.get("LMSP_LOG_LEVEL", "INFO"),
            # Nothing here uses what workers tell each other at start (mingle:
            # revoked ids, a second of the start) or after (gossip).
            "--without-mingle",
            "--without-gossip",
            *sys.argv[1:],
        ]
    )


if __name__ == "__main__":
    main()
