from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis
from django.conf import settings
from django.db import connections

from accounts_app.models import SCOPES
from accounts_app.services import create_token
from generation.registry import get_model
from lmsp_core.status import FINAL_STATUSES as FINAL
from lmsp_project.celery import app as celery_app
from lmsp_project.devstack import free_port, start_redis
from lmsp_project.vllm import VllmServer, preload, vllm_python

from .fresh_clone import ServedClone
from .stack import LOGS, STACK_SETTINGS, Stack, start_together

# Begun as soon as the tests that need them are collected, so that their
# starts (minutes) overlap the tests before them: vLLM's server for the
# upstream tests, and a fresh clone served as the README says.
_vllm: VllmServer | None = None
_fresh_clone: ServedClone | None = None

ALL_SCOPES = list(SCOPES)


@pytest.fixture(scope="session", autouse=True)
def stack_settings() -> int:
    """The test process runs sweeps and prunes itself: same timings as the stack,
    and the stack's own Redis (started with the stack), which tests may restart."""
    for name, value in STACK_SETTINGS.items():
        setattr(settings, name, float(value))
    redis_port = free_port()
    settings.REDIS_URL = settings.CELERY_BROKER_URL = f"redis://127.0.0.1:{redis_port}/0"
    celery_app.conf.broker_url = settings.REDIS_URL
    return redis_port


@pytest.fixture(scope="session")
def stack(django_db_setup, django_db_blocker, stack_settings: int) -> Iterator[Stack]:  # noqa: ANN001
    """Web, model worker and ops worker on the test database (started once)."""
    with django_db_blocker.unblock():
        db = connections["default"].settings_dict
    running = Stack(db, stack_settings)
    running.start()
    yield running
    running.stop()


@pytest.fixture
def broker(stack_settings: int):  # noqa: ANN201
    """The tests' broker Redis (the one the test stack uses), started here when
    the stack is not running; the test queue of the model (the test module's
    ``LMSP_QUEUE_PREFIX``) starts empty. The stack's ops
    worker is stopped meanwhile: its sweeper, every second, would race the
    test's own sweeps for the same aged tasks and hand them to the stack's
    model worker (seen once: the task a test meant to run was run there).
    It starts again before the next test that does not use this fixture
    (``ops_worker_running``)."""
    if Stack.running is not None:
        Stack.running.ops.stop()
    client = redis.Redis(port=stack_settings, socket_connect_timeout=1)
    started = None
    try:
        client.ping()
    except redis.ConnectionError:
        started = start_redis(LOGS / f"redis-{stack_settings}", stack_settings, persist=False)
    queue = get_model("smollm2:135m").queue
    client.delete(queue)
    yield client, queue
    client.delete(queue)
    if started is not None:
        started.kill()
        started.wait(10)


@pytest.fixture(autouse=True)
def ops_worker_running(request: pytest.FixtureRequest) -> None:
    """The stack's ops worker running again for a test that uses the stack
    and not ``broker``, when a test before stopped it. Not at that test's
    teardown: it comes before the database is emptied, and the first sweep of
    an ops worker started then takes its locks in the opposite order to the
    TRUNCATE's (a deadlock, seen once); nor for the tests between that need
    no stack (a start takes seconds)."""
    names = request.fixturenames
    stack = Stack.running
    if stack is not None and not stack.ops.running and "stack" in names and "broker" not in names:
        stack.ops.start()


@pytest.fixture(scope="module")
def lm():  # noqa: ANN201
    """The real model, loaded in the test process (for answers computed alone)."""
    from workers.loading import load_model

    return load_model(get_model("smollm2:135m"))


@pytest.fixture
def restart_after(stack: Stack) -> Iterator[None]:
    """Whatever a test kills or pauses is running again for the next test."""
    yield
    run_again(stack)


def run_again(stack: Stack) -> None:
    """Each of the stack's processes that a test stopped started again, and
    its model worker taking jobs again if the test paused it."""
    start_together(proc for proc in (stack.web, stack.worker, stack.ops) if not proc.running)
    if stack.paused:  # (a worker started again since consumes already: no harm)
        stack.resume_worker()


def make_token(username: str = "alice", scopes: list[str] | None = None) -> str:
    return create_token(username=username, scopes=scopes or ALL_SCOPES).secret


@pytest.fixture
def token(transactional_db) -> Iterator[str]:  # noqa: ANN001
    yield make_token()
    settle_generations()


def settle_generations(timeout: float = 120) -> None:
    """Cancel what a test left queued or running, wait until it is final, then
    until the stack's model worker has taken every message of its queues and
    holds no job: the database is emptied (TRUNCATE) after each test, and a
    worker that claims meanwhile (a spare message of a cancelled task: its
    claim locks the model's clock, then reads tasks and responses) holds
    locks in the opposite order to the TRUNCATE's, which deadlocks. Fails
    the test when that does not happen in ``timeout``."""
    from lmsp_core.errors import ProblemError
    from tasks_app import lifecycle
    from tasks_app.models import Task

    for task_id in Task.objects.exclude(status__in=FINAL).values_list("id", flat=True):
        try:
            lifecycle.request_cancel(task_id)
        except ProblemError as exc:  # it ended meanwhile
            if exc.code != "task_not_cancellable":
                raise
        except Task.DoesNotExist:  # it was deleted meanwhile (retention)
            pass
    deadline = time.monotonic() + timeout
    while Task.objects.exclude(status__in=FINAL).exists():
        assert time.monotonic() < deadline, (
            "tasks still not final after the test: "
            f"{list(Task.objects.exclude(status__in=FINAL).values_list('id', 'status'))}"
        )
        time.sleep(0.1)
    if Stack.running is not None:
        Stack.running.wait_until_the_worker_is_idle(deadline - time.monotonic())


@pytest.fixture
def api(stack: Stack, token: str):  # noqa: ANN201
    with stack.client(token) as client:
        yield client


def user_message(text: str) -> dict:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


# Greedy SmolLM2 writes well over 400 tokens for this: it keeps a worker busy.
LONG_STORY = "Write a long, detailed story about a lighthouse keeper."


def request_body(text: str = "Say hello in one short sentence.", **extra: object) -> dict:
    body = {
        "model": "smollm2:135m",
        "input": [user_message(text)],
        "max_output_tokens": 16,
        "temperature": 0,
    }
    body.update(extra)
    return body


def output_text(response: dict) -> str:
    """The text of a response object's output messages."""
    return "".join(
        part["text"]
        for item in response["output"]
        if item["type"] == "message"
        for part in item["content"]
    )


def parse_sse(raw: str) -> list[dict]:
    """Events of an SSE body: dicts with id, event, data (parsed) and comments seen."""
    events = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        fields: dict = {}
        for line in block.split("\n"):
            if line.startswith(":"):
                fields.setdefault("comments", []).append(line)
                continue
            name, _, value = line.partition(": ")
            fields[name] = value
        if "data" in fields:
            fields["data"] = json.loads(fields["data"])
            # none: an error event that ends a stream cut short (not of the log)
            fields["id"] = int(fields["id"]) if "id" in fields else None
        events.append(fields)
    return [e for e in events if "event" in e]


def deltas_text(events: list[dict], item_id: str | None = None) -> str:
    return "".join(
        e["data"]["delta"]
        for e in events
        if e["event"] == "response.output_text.delta"
        and (item_id is None or e["data"]["item_id"] == item_id)
    )


def give_up_on(stack: Stack, token: str, path: str, body: dict, seconds: float = 3) -> float:
    """POST ``body`` as a client that stops waiting for the answer after
    ``seconds`` and leaves; returns when it left (``time.monotonic``)."""
    with stack.client(token, timeout=httpx.Timeout(seconds, connect=10)) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.post(path, json=body)
    return time.monotonic()


def settled(record, left_at: float, within: float = 5):  # noqa: ANN001, ANN201
    """``record`` (a task or a response) read again until it is no longer in
    progress, or ``within`` seconds after ``left_at``."""
    while record.status == "in_progress" and time.monotonic() - left_at < within:
        time.sleep(0.05)
        record.refresh_from_db()
    return record


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """What ``scripts/test --fast`` (``-m "not e2e and not model"``) leaves
    out, whatever a test's module says: a test using the running stack or its
    broker is an e2e test, one using the real model (``lm``) a model test."""
    for item in items:
        needs = set(getattr(item, "fixturenames", ()))
        if needs & {"stack", "broker"}:
            item.add_marker(pytest.mark.e2e)
        if "lm" in needs:
            item.add_marker(pytest.mark.model)
    items.sort(key=_while_slow_starts)


def _while_slow_starts(item: pytest.Item) -> int:
    """The order of a run: vLLM's server and the fresh clone start in the
    background at collection (``pytest_collection_finish``) and take both
    cores of a small machine for a minute or two, so the tests that need
    neither the model nor the stack go first (nothing they assert depends on
    the time), then the fresh clone's (its processes are gone after them),
    then vLLM's own, then those that use the broker alone (the stack's ops
    worker stopped once for all of them: ``broker``), then every other, none
    of them beside a start (the sort is stable: each part keeps the files'
    order)."""
    if not item.get_closest_marker("e2e") and not item.get_closest_marker("model"):
        return 0
    if _uses(item, "fresh_clone"):
        return 1
    if _uses(item, "vllm"):
        return 2
    return 3 if _uses(item, "broker") else 4


def pytest_collection_finish(session: pytest.Session) -> None:
    """Begin vLLM's server and the fresh clone when a selected test needs them."""
    global _vllm, _fresh_clone
    if any(_uses(item, "vllm") for item in session.items):
        python = vllm_python()
        preloaded = preload(python) if python is not None else None
        assert python is not None and preloaded is not None, "vLLM's CPU build is needed"
        _vllm = VllmServer(python, preloaded, free_port(), LOGS / "vllm.log", eager=True)
        _vllm.start()
    if any(_uses(item, "fresh_clone") for item in session.items):
        _fresh_clone = ServedClone.begin()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """vLLM's server stops once the last test using it is torn down: idle,
    its engine process still takes a share of a core from every later test.
    (Those tests run one after the other: ``_while_slow_starts``.)"""
    last = nextitem is None or not _uses(nextitem, "vllm")
    if _vllm is not None and _uses(item, "vllm") and last:
        _vllm.stop()


def _uses(item: pytest.Item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _vllm is not None:
        _vllm.stop()
    if _fresh_clone is not None:
        _fresh_clone.end()


@pytest.fixture(scope="module")
def fresh_clone() -> Iterator[ServedClone]:
    """A fresh clone served by ``scripts/serve`` (begun at collection), ready;
    nothing of it is left running after the module."""
    assert _fresh_clone is not None
    _fresh_clone.wait_until_served()
    yield _fresh_clone
    _fresh_clone.end()


@pytest.fixture(scope="session")
def vllm() -> VllmServer:
    """vLLM's CPU server on the converted SmolLM2 weights, up (started at collection)."""
    assert _vllm is not None
    _vllm.wait()
    return _vllm
