"""Every change of a task row is a line of the lifecycle's table
(``tasks_app.transitions``): each transition is made for real against
PostgreSQL, where a trigger records every change of the row (its status
before and after, the columns that changed), and each recorded change must
be allowed by its line; a second trigger records each change of a
response's status, which must be exactly the move its task's line states;
and the code that writes the task table, or a response's status, is exactly
what the table names."""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection
from django.utils import timezone

from generation.output import OutputAssembler
from generation.params import GenerationParams
from generation.registry import get_model
from lmsp_core.status import FINAL_STATUSES as FINAL
from lmsp_core.status import Status
from tasks_app import checkpoints, claims, endings, lifecycle, retention, sweeper, upstream_waits
from tasks_app.models import OwnerQuota, Task
from tasks_app.transitions import TRANSITIONS, writers

from .test_layers import PACKAGES
from .test_lifecycle import new_task

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parent.parent

RECORD_CHANGES = """
CREATE TABLE lmsp_test_task_changes (
    id serial PRIMARY KEY, task_id text, before_status text, after_status text, changed text[]
);
CREATE FUNCTION lmsp_test_record_task_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO lmsp_test_task_changes (task_id, before_status, after_status, changed)
        VALUES (NEW.id, NULL, NEW.status, ARRAY['*']);
    ELSE
        INSERT INTO lmsp_test_task_changes (task_id, before_status, after_status, changed)
        SELECT NEW.id, OLD.status, NEW.status, coalesce(array_agg(n.key ORDER BY n.key), '{}')
          FROM jsonb_each(to_jsonb(NEW)) AS n
         WHERE n.value IS DISTINCT FROM to_jsonb(OLD) -> n.key;
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER lmsp_test_task_changes AFTER INSERT OR UPDATE ON tasks_app_task
    FOR EACH ROW EXECUTE FUNCTION lmsp_test_record_task_change();
CREATE TABLE lmsp_test_response_changes (
    id serial PRIMARY KEY, response_id text, before_status text, after_status text
);
CREATE FUNCTION lmsp_test_record_response_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO lmsp_test_response_changes (response_id, before_status, after_status)
        VALUES (NEW.id, NULL, NEW.status);
    ELSIF OLD.status IS DISTINCT FROM NEW.status THEN
        INSERT INTO lmsp_test_response_changes (response_id, before_status, after_status)
        VALUES (NEW.id, OLD.status, NEW.status);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER lmsp_test_response_changes AFTER INSERT OR UPDATE ON responses_app_response
    FOR EACH ROW EXECUTE FUNCTION lmsp_test_record_response_change();
"""
FORGET_CHANGES = """
DROP TRIGGER IF EXISTS lmsp_test_task_changes ON tasks_app_task;
DROP FUNCTION IF EXISTS lmsp_test_record_task_change();
DROP TABLE IF EXISTS lmsp_test_task_changes;
DROP TRIGGER IF EXISTS lmsp_test_response_changes ON responses_app_response;
DROP FUNCTION IF EXISTS lmsp_test_record_response_change();
DROP TABLE IF EXISTS lmsp_test_response_changes;
"""


@pytest.fixture(autouse=True)
def private_queue(settings) -> None:  # noqa: ANN001
    """Jobs go to a queue no worker of the test stack serves (as test_lifecycle)."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-transitions"


Changes = tuple[list[tuple], list[tuple[str | None, str]]]


@pytest.fixture
def changes(transactional_db) -> Iterator[Callable[[], Changes]]:  # noqa: ANN001
    """The changes of task rows, and the moves of responses' statuses
    (before, after), recorded since the last call (and forgotten)."""
    with connection.cursor() as cursor:
        cursor.execute(FORGET_CHANGES)
        cursor.execute(RECORD_CHANGES)

    def taken() -> Changes:
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM lmsp_test_task_changes"
                " RETURNING id, task_id, before_status, after_status, changed"
            )
            rows = sorted(cursor.fetchall())
            cursor.execute(
                "DELETE FROM lmsp_test_response_changes RETURNING id, before_status, after_status"
            )
            moves = [(before, after) for _, before, after in sorted(cursor.fetchall())]
        tasks = [
            (task_id, before, after, frozenset(changed))
            for _, task_id, before, after, changed in rows
        ]
        return tasks, moves

    yield taken
    with connection.cursor() as cursor:
        cursor.execute(FORGET_CHANGES)


def claimed() -> Task:
    task = new_task()
    taken = claims.claim(task.id, "w1")
    assert taken is not None and taken.id == task.id
    return taken


def claimed_then(*changes: Callable[[Task], object]) -> Task:
    task = claimed()
    for change in changes:
        change(task)
    return task


def expire_lease(task: Task) -> None:
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(seconds=1))


def age(task: Task) -> Task:
    Task.objects.filter(id=task.id).update(enqueued_at=timezone.now() - timedelta(hours=1))
    return task


def ended(status: str) -> Callable[[Task], object]:
    return lambda task: endings.finish(
        task.id, task.attempt, [], endings.Outcome(status=status, error={})
    )


def with_running_limit() -> Task:
    task = new_task()
    OwnerQuota.objects.update_or_create(owner_id=task.owner_id, defaults={"max_running": 2})
    return task


def not_allowed_to_its_owner() -> Task:
    task = new_task()
    OwnerQuota.objects.update_or_create(owner_id=task.owner_id, defaults={"allowed_models": []})
    return task


def scenarios(empty_queue: Callable[[], object]) -> list[tuple[str, Callable, Callable]]:
    """(the transition, a set-up whose own writes are not counted and that
    returns a task, the change itself, given that task)."""

    def sweep(_: Task) -> object:
        return sweeper.sweep()

    def claim(task: Task) -> object:
        return claims.claim(task.id, "w1")

    def cancel(task: Task) -> object:
        return lifecycle.request_cancel(task.id)

    def progress(task: Task) -> object:
        delta = ("response.output_text.delta", {"delta": "Hi"})
        return checkpoints.record_progress(task.id, task.attempt, [delta], [1, 2], {"tokens": 2})

    def hand_back(task: Task, waiting: upstream_waits.Waiting | None = None) -> object:
        assembler = OutputAssembler.for_generation(
            task.response_id, GenerationParams(), get_model(task.model)
        )
        checkpoint = {
            "tokens": 2,
            "detokenizer": {"prefix": 0, "read": 0},
            "assembler": assembler.compact_state(),
        }
        flush = checkpoints.Flush(task.id, task.attempt, [], [1, 2], checkpoint)
        return checkpoints.hand_back(flush, waiting=waiting)

    def upstream_down(timeout_seconds: float) -> Callable[[Task], object]:
        waiting = upstream_waits.Waiting("http://gpu:8000/v1 answered 503", timeout_seconds, 10)
        return lambda task: hand_back(task, waiting)

    def waited(task: Task) -> None:
        Task.objects.filter(id=task.id).update(waiting_reason="503", waiting_since=timezone.now())

    def past_its_attempts(task: Task) -> None:
        Task.objects.filter(id=task.id).update(attempt=settings.LMSP_MAX_ATTEMPTS)

    def model_removed(task: Task) -> None:
        Task.objects.filter(id=task.id).update(model="removed:1b")

    return [
        ("services.start_task", lambda: None, lambda _: new_task()),
        ("claims.claim", new_task, claim),
        ("claims.claim", with_running_limit, claim),  # the owner's running tasks counted
        ("claims.claim (may no longer run)", not_allowed_to_its_owner, claim),
        ("checkpoints.record_progress", claimed, progress),
        ("claims.renew_lease", claimed, lambda t: claims.renew_lease(t.id, t.attempt)),
        ("endings.finish", claimed, ended(Status.COMPLETED)),
        ("lifecycle.request_cancel (queued)", new_task, cancel),
        ("lifecycle.request_cancel (running)", claimed, cancel),
        ("checkpoints.hand_back", claimed, hand_back),
        ("checkpoints.hand_back (cancelled meanwhile)", lambda: claimed_then(cancel), hand_back),
        ("checkpoints.hand_back (upstream unavailable)", claimed, upstream_down(600)),
        ("checkpoints.hand_back (waited too long)", claimed, upstream_down(0)),
        (
            "upstream_waits.recovered",
            lambda: claimed_then(waited),
            lambda task: upstream_waits.recovered(task.id, task.attempt),
        ),
        ("sweeper.sweep (lease expired, re-queued)", lambda: claimed_then(expire_lease), sweep),
        (
            "sweeper.sweep (lease expired, ended)",
            lambda: claimed_then(cancel, expire_lease),
            sweep,
        ),
        (
            "sweeper.sweep (lease expired, ended)",
            lambda: claimed_then(past_its_attempts, expire_lease),
            sweep,
        ),
        ("sweeper.sweep (message lost, re-sent)", lambda: age(new_task()), sweep),  # behind
        (
            "sweeper.sweep (message lost, re-sent)",  # its message is gone: sent again
            lambda: (age(new_task()), empty_queue())[0],
            sweep,
        ),
        (
            "sweeper.sweep (queued, model gone)",
            lambda: (task := age(new_task()), model_removed(task), empty_queue())[0],
            sweep,
        ),
        (
            "lifecycle.requeue_failed",
            lambda: claimed_then(ended(Status.FAILED)),
            lambda task: lifecycle.requeue_failed(task.id),
        ),
        (
            "retention.prune_events",
            lambda: claimed_then(ended(Status.COMPLETED)),
            lambda _: retention.prune_events(older_than=0),
        ),
    ]


def test_every_change_of_a_task_is_allowed_by_its_line(changes, broker):
    client, queue = broker
    made = set()
    for name, set_up, change in scenarios(lambda: client.delete(queue)):
        task = set_up()
        changes()  # the set-up's own writes are not the transition's
        change(task)
        recorded, moved = changes()
        assert recorded, f"{name}: no change recorded"
        transition = TRANSITIONS[name]
        for task_id, before, after, changed in recorded:
            assert transition.allows(before, after, changed), (
                f"{name} changed {task_id} {before} -> {after}, setting {sorted(changed)}"
            )
        # its response moves as its line says, once, or not at all
        assert set(moved) <= transition.response_moves, f"{name} moved its response: {moved}"
        assert len(moved) == min(1, len(transition.response_moves)), (
            f"{name} moved its response {moved}, its line: {transition.response_moves}"
        )
        made.add(name)
        # the next scenario starts alone: its claim takes its own task
        Task.objects.exclude(status__in=FINAL).update(status=Status.CANCELLED)
        OwnerQuota.objects.all().delete()
        changes()
    assert made == set(TRANSITIONS)


def test_a_change_outside_its_line_is_refused():
    claim = TRANSITIONS["claims.claim"]
    assert claim.allows("queued", "in_progress", frozenset({"status", "attempt", "worker"}))
    assert not claim.allows("queued", "in_progress", frozenset({"status", "checkpoint"}))
    assert not claim.allows("failed", "in_progress", frozenset({"status"}))
    prune = TRANSITIONS["retention.prune_events"]
    assert not prune.allows("completed", "failed", frozenset({"status", "pruned_through"}))
    assert not prune.allows("completed", "completed", frozenset({"*"}))


def test_a_response_is_in_progress_until_its_task_ends_with_the_same_status():
    assert TRANSITIONS["services.start_task"].response_moves == {(None, "in_progress")}
    assert not TRANSITIONS["claims.claim"].response_moves
    assert not TRANSITIONS["checkpoints.hand_back"].response_moves
    assert not TRANSITIONS["retention.prune_events"].response_moves
    assert TRANSITIONS["lifecycle.request_cancel (queued)"].response_moves == {
        ("in_progress", "cancelled")
    }
    assert TRANSITIONS["endings.finish"].response_moves == {
        ("in_progress", str(status)) for status in FINAL
    }
    assert TRANSITIONS["lifecycle.requeue_failed"].response_moves == {("failed", "in_progress")}


# --- the writers of the task table and of responses' statuses, read from the code ---


TASK_WRITES = ("UPDATE tasks_app_task", "INSERT INTO tasks_app_task")
ORM_WRITES = {"update", "save", "create", "bulk_create", "bulk_update", "update_or_create"}


def _names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _writes_tasks(node: ast.AST) -> bool:
    """Whether a statement writes task rows: SQL that updates or inserts into
    the task table, an ORM write through ``Task`` (or a ``task.save()``), or
    ``Task`` handed to a function that builds an insert."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            if any(write in " ".join(inner.value.split()) for write in TASK_WRITES):
                return True
        if isinstance(inner, ast.Call):
            func = inner.func
            if isinstance(func, ast.Attribute) and func.attr in ORM_WRITES:
                receiver = _names_in(func.value)
                if "Task" in receiver or (func.attr == "save" and receiver == {"task"}):
                    return True
            if isinstance(func, ast.Name) and "insert" in func.id:
                if any(isinstance(arg, ast.Name) and arg.id == "Task" for arg in inner.args):
                    return True
    return False


def _writes_response_status(node: ast.AST) -> bool:
    """Whether a statement sets a response's status: SQL that updates the
    response table's status, or an ORM write given ``status`` through
    anything named for responses (``Response``, ``response_model``)."""
    for inner in ast.walk(node):
        if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
            sql = " ".join(inner.value.split())
            if "UPDATE responses_app_response" in sql and "status" in sql:
                return True
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute):
            receiver = _names_in(inner.func.value)
            sets_status = any(keyword.arg == "status" for keyword in inner.keywords)
            if inner.func.attr in ORM_WRITES and sets_status:
                if any("response" in name.lower() for name in receiver):
                    return True
    return False


def writers_in_code(writes: Callable[[ast.AST], bool] = _writes_tasks) -> set[str]:
    """``module.function`` (or ``module.CONSTANT``) of every statement of the
    service that ``writes`` (task rows, by default); modules of ``tasks_app``
    by their short name, others by their dotted path."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            module = dotted.removeprefix("tasks_app.")
            tree = ast.parse(path.read_text(), str(path))
            for scope in ast.walk(tree):
                if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef):
                    own = [n for n in scope.body]
                    inner_defs = {
                        id(n)
                        for n in ast.walk(scope)
                        if n is not scope and isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
                    }
                    if any(writes(n) for n in own if id(n) not in inner_defs):
                        found.add(f"{module}.{scope.name}")
            for statement in tree.body:
                if isinstance(statement, ast.Assign) and writes(statement):
                    for target in statement.targets:
                        if isinstance(target, ast.Name):
                            found.add(f"{module}.{target.id}")
    return found


def test_the_table_names_every_writer_of_the_task_table():
    assert writers_in_code() == writers()


def test_only_the_lifecycle_moves_a_response_s_status():
    assert writers_in_code(_writes_response_status) == {"transitions.move_response"}
