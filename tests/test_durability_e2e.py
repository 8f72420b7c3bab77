"""A task survives its worker, the web process and Redis: each is killed here
for real, mid-task, and the task still ends with one contiguous stream."""

from __future__ import annotations

import threading

import pytest

from tasks_app.models import Event, Task

from .conftest import LONG_STORY, deltas_text, parse_sse, user_message
from .test_tasks_e2e import (
    assert_one_contiguous_stream,
    create_task,
    read_events,
    wait_for,
    wait_for_events,
)

pytestmark = pytest.mark.e2e

LONG = [user_message(LONG_STORY)]


def test_killed_worker_is_replaced_and_the_stream_stays_contiguous(
    api, stack, token, restart_after
):
    task = create_task(api, input=LONG, max_output_tokens=120, temperature=0)
    live: list[dict] = []

    def follow() -> None:  # a reader connected across the crash
        with stack.client(token) as client:
            live.extend(read_events(client, task["id"]))

    reader = threading.Thread(target=follow)
    reader.start()
    wait_for_events(task["id"], 12)
    stack.worker.kill()  # SIGKILL, mid-generation
    before = Task.objects.get(id=task["id"])
    assert before.status == "in_progress" and before.attempt == 1
    stack.worker.start()
    done = wait_for(api, task["id"], timeout=180)
    reader.join(60)
    assert done["status"] in ("completed", "incomplete")
    assert Task.objects.get(id=task["id"]).attempt == 2
    events = read_events(api, task["id"])
    assert_one_contiguous_stream(events, done)
    assert live == events  # the live reader got every event exactly once
    assert len({e["data"]["item"]["id"] for e in events if "item" in e["data"]}) == 1
    seqs = list(Event.objects.filter(task_id=task["id"]).values_list("seq", flat=True))
    assert seqs == list(range(1, len(seqs) + 1))


def test_web_restart_mid_stream_loses_nothing_after_reconnecting(api, stack, restart_after):
    task = create_task(api, input=LONG, max_output_tokens=80, temperature=0)
    seen: list[dict] = []
    with pytest.raises(Exception):  # noqa: B017 - the connection breaks, however httpx words it
        with api.stream("GET", f"/lmsp/v1/tasks/{task['id']}/events") as answer:
            buffer = ""
            for chunk in answer.iter_text():
                buffer += chunk
                *blocks, buffer = buffer.split("\n\n")
                seen += parse_sse("\n\n".join(blocks) + "\n\n")
                if len(seen) >= 5 and stack.web.process.poll() is None:
                    stack.web.kill()
    assert seen, "no event arrived before the restart"
    stack.web.start()
    rest = read_events(api, task["id"], headers={"Last-Event-ID": str(seen[-1]["id"])})
    done = wait_for(api, task["id"])
    assert_one_contiguous_stream(seen + rest, done)


def test_redis_restarted_empty_while_queued_still_completes(api, stack, restart_after):
    stack.worker.stop()  # nothing consumes: the job waits in Redis
    task = create_task(api, max_output_tokens=6)
    stack.stop_redis()  # the queued message is lost with it
    stack.start_redis()
    assert Task.objects.get(id=task["id"]).status == "queued"
    stack.worker.start()
    done = wait_for(api, task["id"], timeout=120)  # the sweeper sends it again
    assert done["status"] in ("completed", "incomplete")
    events = read_events(api, task["id"])
    assert_one_contiguous_stream(events, done)
    assert deltas_text(events)


def test_redis_restarted_with_eight_generations_running_keeps_the_worker(
    api, stack, token, restart_after
):
    """A Redis restart while the model worker runs 8 jobs (its threads ack
    and flush meanwhile) leaves that very worker process running: every
    generation ends with one contiguous stream, a task sent after the restart
    is served, and the worker answers its control messages again (the
    fixture's settling asks it)."""
    pid = stack.worker.process.pid
    tasks = [create_task(api, input=LONG, max_output_tokens=60, temperature=0) for _ in range(8)]
    wait_for_events(tasks[0]["id"], 8)
    stack.stop_redis()
    assert stack.worker.process.poll() is None
    stack.start_redis()
    for task in tasks:
        done = wait_for(api, task["id"], timeout=300)
        assert done["status"] in ("completed", "incomplete")
        assert_one_contiguous_stream(read_events(api, task["id"]), done)
    after = create_task(api, max_output_tokens=6)
    done = wait_for(api, after["id"], timeout=180)
    assert done["status"] in ("completed", "incomplete")
    assert stack.worker.process.poll() is None and stack.worker.process.pid == pid
