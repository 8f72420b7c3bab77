"""Deploys nobody notices: a model worker told to stop (SIGTERM, as compose,
systemd and Kubernetes stop a process) hands every generation it holds to
the worker started in its place, and the followers see no gap."""

from __future__ import annotations

import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from lmsp_project.devstack import free_port
from tasks_app.models import Task

from .conftest import deltas_text, user_message
from .test_deployment import manage
from .test_engine_e2e import request_of, texts_uninterrupted
from .test_streams_e2e import Follower, _pg_start, _pg_stop
from .test_tasks_e2e import assert_one_contiguous_stream, create_task, read_events, wait_for

pytestmark = pytest.mark.e2e

STORY = [user_message("Tell me a long story about a lighthouse keeper and the sea.")]
# Eight different prompts: a generation handed to the wrong request on its way
# to the successor would end with another prompt's answer.
STORIES = [
    [user_message(f"Tell me a long story about a lighthouse keeper and {subject}.")]
    for subject in (
        "the sea",
        "a lost ship",
        "her cat",
        "a winter storm",
        "the last lamp",
        "a whale",
        "his brother",
        "the fog horn",
    )
]


def test_a_drained_worker_hands_eight_generations_to_the_worker_started_beside_it(
    api, stack, token, restart_after, lm
):
    # Long enough that none ends before the drain hands them over, which may
    # wait LMSP_DRAIN_WAIT_SECONDS (10 s) for the successor, on a fast CPU
    # too: at 200 tokens, eight ended on the drained worker (AMD EPYC,
    # AVX-512), never handed over.
    tasks = [
        create_task(api, input=story, max_output_tokens=300, temperature=0) for story in STORIES
    ]
    # Each prompt's uninterrupted answer, computed meanwhile on a thread of
    # this process, which waits anyway (it only slows the generations down).
    pool = ThreadPoolExecutor(1)
    requests = [request_of(lm, task["response_id"]) for task in tasks]
    uninterrupted = pool.submit(texts_uninterrupted, lm, requests)
    followers = [Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events") for task in tasks]
    for follower in followers:
        follower.wait_for(6, timeout=120)  # all 8 are generating
    old = stack.worker.process
    successor = stack.another_worker("successor")
    starting = threading.Thread(target=successor.start)
    try:
        signalled = time.monotonic()
        old.send_signal(signal.SIGTERM)  # as a rolling deploy does, the new one at once
        starting.start()
        old.wait(30)
        exited = time.monotonic() - signalled
        starting.join(120)
        for task, follower, answer in zip(tasks, followers, uninterrupted.result(), strict=True):
            done = wait_for(api, task["id"], timeout=300)
            assert done["status"] in ("completed", "incomplete")
            events = follower.finish()
            assert events == read_events(api, task["id"])  # every event once, in order
            assert_one_contiguous_stream(events, done)
            # its own prompt's answer, as if it had never moved
            assert deltas_text(events) == answer
        workers = {Task.objects.get(id=task["id"]).worker for task in tasks}
    finally:
        successor.stop()
        pool.shutdown(cancel_futures=True)
    assert exited <= 15, f"the drained worker exited after {exited:.1f} s"
    # Each handed on by the drained worker, none waiting for a lease to
    # expire (the sweeper's way, which a follower sees as a pause): two
    # attempts, one of them handed back.
    handed = [Task.objects.values_list("attempt", "handed_back").get(id=t["id"]) for t in tasks]
    assert handed == [(2, 1)] * len(tasks)
    assert workers == {f"models-{successor.process.pid}@{socket.gethostname()}"}


def test_the_probes_answer_as_documented_with_each_dependency_stopped_in_turn(stack, restart_after):
    """``/livez``: the process answers (nothing else is checked, so an outage
    never gets every web process restarted); ``/readyz`` (and ``/healthz``):
    PostgreSQL and Redis reachable, else 503 naming which is not. No token.
    A model worker's probe (``lmsp_health worker``): its heartbeat, in Redis."""
    with httpx.Client(base_url=stack.base_url, timeout=60) as client:
        for path in ("/readyz", "/healthz"):
            ready = client.get(path)
            assert (ready.status_code, ready.text) == (200, "database ok\nredis ok\n")
        stack.stop_redis()
        try:
            answer = client.get("/readyz")
            assert (answer.status_code, answer.text) == (503, "database ok\nredis unreachable\n")
            assert client.get("/livez").status_code == 200
            worker = manage(stack, "lmsp_health", "worker")
            assert worker.returncode == 1 and "Redis cannot be asked" in worker.stderr
        finally:
            stack.start_redis()
        _pg_stop()
        try:
            answer = client.get("/readyz")
            assert (answer.status_code, answer.text) == (503, "database unreachable\nredis ok\n")
            assert client.get("/livez").text == "ok\n"
            worker = manage(stack, "lmsp_health", "worker")  # it beats: its model is loaded
            assert worker.returncode == 0, worker.stderr
        finally:
            _pg_start()
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "not ready again after the restarts"
            time.sleep(0.5)


def test_two_workers_share_a_queue_and_either_may_die(api, stack, token, restart_after):
    """Two model workers of one model, as two hosts run them: tasks spread
    over both, and a kill -9 of one leaves every generation complete, with
    one contiguous stream each (the other, or the one started again,
    continues what the dead one held once its leases expire)."""
    second = stack.another_worker("second")
    second.start()
    try:
        tasks = [
            create_task(api, input=STORY, max_output_tokens=60, temperature=0) for _ in range(12)
        ]
        followers = [
            Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events") for task in tasks
        ]
        deadline = time.monotonic() + 120
        while True:  # both workers hold some of them
            held = set(
                Task.objects.filter(id__in=[t["id"] for t in tasks], status="in_progress")
                .exclude(worker="")
                .values_list("worker", flat=True)
            )
            if len(held) == 2:
                break
            assert time.monotonic() < deadline, f"held by {held}"
            time.sleep(0.1)
        second.kill()  # SIGKILL, mid-generation
        for task, follower in zip(tasks, followers, strict=True):
            done = wait_for(api, task["id"], timeout=300)
            assert done["status"] in ("completed", "incomplete")
            events = follower.finish(timeout=300)
            assert events == read_events(api, task["id"])
            assert_one_contiguous_stream(events, done)
    finally:
        second.stop()


def test_a_web_process_told_to_stop_closes_its_streams_and_they_resume_elsewhere(api, stack, token):
    """SIGTERM to a web process: it stops accepting, and closes the streams
    still open after 5 s (``--timeout-graceful-shutdown``, as the Procfile
    runs it) without a final event; a follower resumes on another web
    process after its last id and misses nothing."""
    port = free_port()
    stopping = stack.another_web(port, "web-stopping")
    stopping.start()
    task = create_task(api, input=STORY, max_output_tokens=300, temperature=0)
    follower = Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events", port=port)
    follower.wait_for(5, timeout=120)
    signalled = time.monotonic()
    stopping.process.send_signal(signal.SIGTERM)
    stopping.process.wait(30)
    stopped = time.monotonic() - signalled
    follower.join(30)
    assert not follower.is_alive()
    seen = list(follower.events)
    assert seen[-1]["event"] not in ("response.completed", "response.incomplete")
    assert Task.objects.get(id=task["id"]).status == "in_progress"  # cut, not ended
    rest = read_events(api, task["id"], headers={"Last-Event-ID": str(seen[-1]["id"])})
    done = wait_for(api, task["id"], timeout=300)
    assert_one_contiguous_stream(seen + rest, done)
    assert stopped <= 5 + 5, f"the web process took {stopped:.1f} s to stop"
