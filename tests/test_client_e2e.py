"""lmsp_client and the ``lmsp`` command against the real stack: a follow
that outlives a kill -9 of the web process or of the model worker delivers
every event once and in order, a pruned history raises its own exception,
and the typed events match what the service sends, type by type."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from django.core.management import call_command
from django.db import connection

import lmsp_client
from lmsp_client import Client, output_text
from tasks_app.models import Task

from .conftest import LONG_STORY, parse_sse

pytestmark = pytest.mark.e2e

LMSP = str(Path(sys.executable).with_name("lmsp"))  # the console script
EXIT = {"completed": 0, "incomplete": 3, "cancelled": 5}
CITY_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
    },
}


@pytest.fixture
def client(stack, token):
    with Client(stack.base_url, token) as lmsp:
        yield lmsp


def wait_final(client: Client, task_id: str, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        task = client.get_task(task_id)
        if task["status"] in ("completed", "incomplete", "failed", "cancelled"):
            return task
        assert time.monotonic() < deadline, f"task {task_id} still {task['status']}"
        time.sleep(0.1)


def wait_for_events(task_id: str, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while Task.objects.get(id=task_id).last_event_id < count:
        assert time.monotonic() < deadline, "the task produced no events"
        time.sleep(0.05)


def raw_events(stack, token, task_id: str) -> list[dict]:
    """The task's whole stream as the service sends it, read without the client."""
    with stack.client(token) as http:
        with http.stream("GET", f"/lmsp/v1/tasks/{task_id}/events") as answer:
            assert answer.status_code == 200
            return parse_sse("".join(answer.iter_text()))


def text_of(events: list[lmsp_client.Event]) -> str:
    return "".join(e.delta for e in events if isinstance(e, lmsp_client.OutputTextDelta))


def assert_whole_stream(events: list[lmsp_client.Event], task: dict) -> None:
    """Every event once, in order, ending with the final one, and the text
    the task stored."""
    assert [e.id for e in events] == list(range(1, task["last_event_id"] + 1))
    assert isinstance(events[0], lmsp_client.ResponseCreated)
    assert events[-1].is_final and events[-1].event_type == f"response.{task['status']}"
    assert text_of(events) == output_text(task["result"])


def follow_with(
    client: Client, task_id: str, at: int, action: Callable[[], None]
) -> tuple[list[lmsp_client.Event], list[lmsp_client.Reconnect]]:
    """Follow a task; when the ``at``-th event arrives, run ``action`` in a
    thread while the follow goes on."""
    events: list[lmsp_client.Event] = []
    reconnects: list[lmsp_client.Reconnect] = []
    helper = threading.Thread(target=action)
    for event in client.follow(task_id, on_reconnect=reconnects.append):
        events.append(event)
        if len(events) == at:
            helper.start()
    helper.join(300)
    assert not helper.is_alive()
    return events, reconnects


# --- resuming across crashes ----------------------------------------------------------


# Long enough that the task still generates once a killed web process is
# back (its start takes seconds): the follows then resume a live task, not
# replay a finished one.
OUTLIVES_A_WEB_RESTART = 300


def restart_the_web(stack, task_id: str) -> dict:
    """kill -9 the web process and start it again; the task's status and last
    event id once it is back."""
    stack.web.kill()  # SIGKILL, with the follows' connections open
    time.sleep(0.5)  # let them find nobody listening
    stack.web.start()
    try:
        return Task.objects.values("status", "last_event_id").get(id=task_id)
    finally:
        connection.close()  # this thread's


def test_follow_survives_a_kill_9_of_the_web_process(client, stack, token, restart_after):
    task = client.create_task(LONG_STORY, max_output_tokens=OUTLIVES_A_WEB_RESTART, temperature=0)
    starts = stack.web.starts
    back: dict = {}

    def restart_web() -> None:
        while not async_events:  # both follows are reading
            time.sleep(0.05)
        back.update(restart_the_web(stack, task["id"]))

    async_events: list[lmsp_client.Event] = []
    async_reconnects: list[lmsp_client.Reconnect] = []

    async def follow_async() -> None:  # the async twin, across the same crash
        async with lmsp_client.AsyncClient(stack.base_url, token) as lmsp:
            async for event in lmsp.follow(task["id"], on_reconnect=async_reconnects.append):
                async_events.append(event)

    twin = threading.Thread(target=asyncio.run, args=(follow_async(),))
    twin.start()
    events, reconnects = follow_with(client, task["id"], 5, restart_web)
    twin.join(300)
    done = client.get_task(task["id"])
    assert stack.web.starts == starts + 1
    # still generating when the web was back: later events came live
    assert back["status"] == "in_progress" and done["last_event_id"] > back["last_event_id"]
    assert reconnects, "the follow never had to reconnect"
    assert all(r.last_event_id >= 5 for r in reconnects)
    assert_whole_stream(events, done)
    assert async_reconnects and async_events == events


def test_follow_survives_a_kill_9_of_the_model_worker(client, stack, restart_after):
    task = client.create_task(LONG_STORY, max_output_tokens=60, temperature=0)

    def restart_worker() -> None:
        stack.worker.kill()  # SIGKILL, mid-generation
        stack.worker.start()

    events, _ = follow_with(client, task["id"], 12, restart_worker)
    done = client.get_task(task["id"])
    assert Task.objects.get(id=task["id"]).attempt == 2  # a second worker finished it
    assert_whole_stream(events, done)


def test_cli_follow_prints_the_whole_answer_across_a_web_restart(
    client, stack, token, restart_after
):
    env = {**os.environ, "LMSP_BASE_URL": stack.base_url, "LMSP_TOKEN": token}
    created = subprocess.run(
        [LMSP, "--json", "task", "create", LONG_STORY]
        + ["--max-output-tokens", str(OUTLIVES_A_WEB_RESTART)]
        + ["--temperature", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert created.returncode == 0, created.stderr
    task_id = json.loads(created.stdout)["id"]
    follower = subprocess.Popen(
        [LMSP, "task", "follow", task_id],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,  # unbuffered: read(1) takes one byte, communicate() the rest
    )
    first = follower.stdout.read(1)  # it is printing the answer: restart the web now
    assert first
    back = restart_the_web(stack, task_id)
    rest, errors = follower.communicate(timeout=300)
    errors = errors.decode()
    done = client.get_task(task_id)
    assert back["status"] == "in_progress" and done["last_event_id"] > back["last_event_id"]
    assert follower.returncode == EXIT[done["status"]], errors
    assert (first + rest).decode() == output_text(done["result"]) + "\n"
    assert "reconnecting..." in errors
    assert "tokens/s" in errors


# --- pruned history -------------------------------------------------------------------


def test_follow_after_pruning_raises_event_history_expired(client, stack, token):
    task_id = client.create_task("Say hello.", max_output_tokens=4, temperature=0)["id"]
    done = wait_final(client, task_id)
    call_command("lmsp_prune_events", "--older-than", "0")
    with pytest.raises(lmsp_client.EventHistoryExpiredError) as raised:
        list(client.follow(task_id))
    error = raised.value
    assert isinstance(error, lmsp_client.ProblemError)
    assert (error.status, error.code) == (410, "event_history_expired")
    assert error.first_available_event_id is None
    assert error.task_status == done["status"]
    assert error.task_url == f"/lmsp/v1/tasks/{task_id}" and error.task_id == task_id
    assert error.problem["code"] == "event_history_expired" and error.detail
    assert "removed by retention" in str(error) and error.task_url in str(error)
    # a client that had seen everything missed nothing: 204, an empty follow
    assert list(client.follow(task_id, after=done["last_event_id"])) == []
    # the command prints the stored answer instead, and says why on stderr
    cli = subprocess.run(
        [LMSP, "task", "follow", task_id],
        env={**os.environ, "LMSP_BASE_URL": stack.base_url, "LMSP_TOKEN": token},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert cli.returncode == EXIT[done["status"]], cli.stderr
    assert cli.stdout == output_text(done["result"]) + "\n"
    assert "event_history_expired" in cli.stderr or "removed by retention" in cli.stderr


# --- typed events of the live service ----------------------------------------------------


def assert_same_as_sent(events: list[lmsp_client.Event], sent: list[dict]) -> None:
    assert len(events) == len(sent)
    for event, raw in zip(events, sent, strict=True):
        assert (event.id, event.event_type) == (raw["id"], raw["event"])
        assert event.data == raw["data"] and event.to_data() == raw["data"]
        assert not isinstance(event, lmsp_client.UnknownEvent), raw
        for member in type(event).fields:
            assert getattr(event, member) == raw["data"][member]


def test_typed_events_match_what_the_service_sends(client, stack, token):
    # text: created, item added, text deltas, item done, completed or incomplete
    plain = client.create_task("Name a colour.", max_output_tokens=12, temperature=0)
    # a function call: function_call_arguments deltas
    call = client.create_task(
        "What is the weather in Paris?",
        max_output_tokens=60,
        temperature=0,
        tools=[CITY_TOOL],
        tool_choice="required",
    )
    seen: set[type] = set()

    def check_stream(task_id: str) -> dict:
        events = list(client.follow(task_id))
        done = client.get_task(task_id)
        assert [e.id for e in events] == list(range(1, done["last_event_id"] + 1))
        assert_same_as_sent(events, raw_events(stack, token, task_id))
        seen.update(type(e) for e in events)
        return done

    check_stream(plain["id"])
    check_stream(call["id"])
    # cancelled mid-generation
    long = client.create_task(LONG_STORY, max_output_tokens=400, temperature=0)
    wait_for_events(long["id"], 4)
    assert client.cancel(long["id"])["id"] == long["id"]
    assert check_stream(long["id"])["status"] == "cancelled"
    assert lmsp_client.ResponseCancelled in seen
    call_events = list(client.follow(call["id"]))
    arguments = "".join(
        e.delta for e in call_events if isinstance(e, lmsp_client.FunctionCallArgumentsDelta)
    )
    item = next(e.item for e in call_events if isinstance(e, lmsp_client.OutputItemDone))
    assert item["type"] == "function_call" and item["arguments"] == arguments
    assert json.loads(arguments)["city"]
    assert {
        lmsp_client.ResponseCreated,
        lmsp_client.OutputItemAdded,
        lmsp_client.OutputTextDelta,
        lmsp_client.FunctionCallArgumentsDelta,
        lmsp_client.OutputItemDone,
        lmsp_client.ResponseCancelled,
    } <= seen
    assert seen & {lmsp_client.ResponseCompleted, lmsp_client.ResponseIncomplete}


def test_stream_response_yields_typed_events_of_a_direct_stream(client):
    events = list(client.stream_response("Say hello.", max_output_tokens=8, temperature=0))
    assert [e.id for e in events] == list(range(1, len(events) + 1))
    assert isinstance(events[0], lmsp_client.ResponseCreated)
    assert isinstance(events[1], lmsp_client.OutputItemAdded)
    done = events[-2]
    assert isinstance(done, lmsp_client.OutputItemDone)
    assert done.item["content"][0]["text"] == text_of(events)
    final = events[-1]
    assert isinstance(final, lmsp_client.ResponseCompleted | lmsp_client.ResponseIncomplete)
    assert final.usage["output_tokens"] > 0


# --- the plain calls, sync and async ----------------------------------------------------


def test_plain_calls_and_problems(client):
    assert [m["id"] for m in client.models()] == ["smollm2:135m"]
    answer = client.create_response("Say hello.", max_output_tokens=6, temperature=0)
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
    assert output_text(answer)
    ids = [client.create_task("Hi.", max_output_tokens=2)["id"] for _ in range(3)]
    for task_id in ids:
        wait_final(client, task_id)
    assert [t["id"] for t in client.tasks(page_size=1)] == sorted(ids, reverse=True)
    assert list(client.tasks(status="queued")) == []
    with pytest.raises(lmsp_client.ProblemError) as raised:
        client.cancel(ids[0])
    assert (raised.value.status, raised.value.code) == (409, "task_not_cancellable")
    with pytest.raises(lmsp_client.ProblemError) as raised:
        client.get_task("task_01J8M6Q4W2T7N5R3V9X1Z8B0DF")
    assert raised.value.code == "task_not_found" and raised.value.problem["status"] == 404
    with pytest.raises(lmsp_client.ProblemError) as raised:
        client.create_task("Hi.", model="nope")
    assert raised.value.code == "model_not_found" and raised.value.param == "request.model"
    with pytest.raises(lmsp_client.ProblemError) as raised:  # a 4xx is not retried
        list(client.follow("task_01J8M6Q4W2T7N5R3V9X1Z8B0DF"))
    assert raised.value.code == "task_not_found"
    assert list(client.follow(ids[0], after=10_000)) == []  # final, nothing left: 204


def test_async_client_does_the_same(stack, token):
    async def scenario() -> None:
        async with lmsp_client.AsyncClient(stack.base_url, token) as lmsp:
            assert [m["id"] for m in await lmsp.models()] == ["smollm2:135m"]
            answer = await lmsp.create_response("Say hi.", max_output_tokens=4, temperature=0)
            assert answer["object"] == "response"
            streamed = [e async for e in lmsp.stream_response("Hi.", max_output_tokens=4)]
            assert streamed[-1].is_final and isinstance(streamed[0], lmsp_client.ResponseCreated)
            task = await lmsp.create_task("Say hello.", max_output_tokens=8, temperature=0)
            events = [e async for e in lmsp.follow(task["id"])]
            done = await lmsp.get_task(task["id"])
            assert_whole_stream(events, done)
            later = [e async for e in lmsp.follow(task["id"], after=3)]
            assert later == events[3:]
            assert [t["id"] async for t in lmsp.tasks(page_size=1)][0] == task["id"]
            with pytest.raises(lmsp_client.ProblemError) as raised:
                await lmsp.cancel(task["id"])
            assert raised.value.code == "task_not_cancellable"

    asyncio.run(scenario())


def test_cli_commands_and_exit_codes(stack, token):
    env = {**os.environ, "LMSP_BASE_URL": stack.base_url, "LMSP_TOKEN": token}

    def lmsp(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([LMSP, *argv], env=env, capture_output=True, text=True, timeout=120)

    models = lmsp("models", "--json")
    assert models.returncode == 0 and json.loads(models.stdout)[0]["id"] == "smollm2:135m"
    assert lmsp("models").stdout.startswith("smollm2:135m\t")
    ask = lmsp("ask", LONG_STORY, "--max-output-tokens", "3", "--temperature", "0")
    assert ask.returncode == EXIT["incomplete"] and ask.stdout.strip(), ask.stderr
    lines = lmsp("--json", "ask", "Say hello.", "--max-output-tokens", "3").stdout.splitlines()
    streamed = [json.loads(line) for line in lines]
    assert streamed[0]["event"] == "response.created" and streamed[-1]["id"] == len(streamed)
    created = lmsp("task", "create", LONG_STORY, "--max-output-tokens", "400")
    task_id = created.stdout.strip()
    assert created.returncode == 0 and task_id.startswith("task_")
    cancelled = lmsp("task", "cancel", task_id, "--json")
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["id"] == task_id
    followed = lmsp("task", "follow", task_id, "--json")
    assert followed.returncode == EXIT["cancelled"]
    assert json.loads(followed.stdout.splitlines()[-1])["event"] == "response.cancelled"
    listed = lmsp("task", "list", "--json", "--limit", "1")
    assert [json.loads(line)["id"] for line in listed.stdout.splitlines()] == [task_id]
    again = lmsp("task", "cancel", task_id)
    assert again.returncode == 1 and "task_not_cancellable" in again.stderr
    assert lmsp("task", "follow").returncode == 2
    unauthorized = subprocess.run(
        [LMSP, "models"], env={**env, "LMSP_TOKEN": "nope"}, capture_output=True, text=True
    )
    assert unauthorized.returncode == 1 and "unauthorized" in unauthorized.stderr
