"""Every change of a task row is a line of the lifecycle's table
(``tasks_app.transitions``): each transition is made for real against
PostgreSQL, where a trigger records every change of the row (its status
before and after, the columns that changed), and each recorded change must
be allowed by its line; and the code that writes the task table is exactly
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
from tasks_app import lifecycle, retention
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
"""
FORGET_CHANGES = """
DROP TRIGGER IF EXISTS lmsp_test_task_changes ON tasks_app_task;
DROP FUNCTION IF EXISTS lmsp_test_record_task_change();
DROP TABLE IF EXISTS lmsp_test_task_changes;
"""


@pytest.fixture(autouse=True)
def private_queue(settings) -> None:  # noqa: ANN001
    """Jobs go to a queue no worker of the test stack serves (as test_lifecycle)."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-transitions"


@pytest.fixture
def changes(transactional_db) -> Iterator[Callable[[], list[tuple]]]:  # noqa: ANN001
    """The changes of task rows recorded since the last call (and forgotten)."""
    with connection.cursor() as cursor:
        cursor.execute(FORGET_CHANGES)
        cursor.execute(RECORD_CHANGES)

    def taken() -> list[tuple]:
        with connection.cursor() as cursor:
            cursor.execute(
                "DELETE FROM lmsp_test_task_changes"
                " RETURNING id, task_id, before_status, after_status, changed"
            )
            rows = sorted(cursor.fetchall())
        return [
            (task_id, before, after, frozenset(changed))
            for _, task_id, before, after, changed in rows
        ]

    yield taken
    with connection.cursor() as cursor:
        cursor.execute(FORGET_CHANGES)


def claimed() -> Task:
    task = new_task()
    taken = lifecycle.claim(task.id, "w1")
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
    return lambda task: lifecycle.finish(
        task.id, task.attempt, [], lifecycle.Outcome(status=status, error={})
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
        return lifecycle.sweep()

    def claim(task: Task) -> object:
        return lifecycle.claim(task.id, "w1")

    def cancel(task: Task) -> object:
        return lifecycle.request_cancel(task.id)

    def progress(task: Task) -> object:
        delta = ("response.output_text.delta", {"delta": "Hi"})
        return lifecycle.record_progress(task.id, task.attempt, [delta], [1, 2], {"tokens": 2})

    def hand_back(task: Task) -> object:
        assembler = OutputAssembler.for_generation(
            task.response_id, GenerationParams(), get_model(task.model)
        )
        checkpoint = {
            "tokens": 2,
            "detokenizer": {"prefix": 0, "read": 0},
            "assembler": assembler.compact_state(),
        }
        return lifecycle.hand_back(lifecycle.Flush(task.id, task.attempt, [], [1, 2], checkpoint))

    def past_its_attempts(task: Task) -> None:
        Task.objects.filter(id=task.id).update(attempt=settings.LMSP_MAX_ATTEMPTS)

    def model_removed(task: Task) -> None:
        Task.objects.filter(id=task.id).update(model="removed:1b")

    return [
        ("services.start_task", lambda: None, lambda _: new_task()),
        ("lifecycle.claim", new_task, claim),
        ("lifecycle.claim", with_running_limit, claim),  # the owner's running tasks counted
        ("lifecycle.claim (may no longer run)", not_allowed_to_its_owner, claim),
        ("lifecycle.record_progress", claimed, progress),
        ("lifecycle.renew_lease", claimed, lambda t: lifecycle.renew_lease(t.id, t.attempt)),
        ("lifecycle.finish", claimed, ended(Status.COMPLETED)),
        ("lifecycle.request_cancel (queued)", new_task, cancel),
        ("lifecycle.request_cancel (running)", claimed, cancel),
        ("lifecycle.hand_back", claimed, hand_back),
        ("lifecycle.hand_back (cancelled meanwhile)", lambda: claimed_then(cancel), hand_back),
        ("lifecycle.sweep (lease expired, re-queued)", lambda: claimed_then(expire_lease), sweep),
        (
            "lifecycle.sweep (lease expired, ended)",
            lambda: claimed_then(cancel, expire_lease),
            sweep,
        ),
        (
            "lifecycle.sweep (lease expired, ended)",
            lambda: claimed_then(past_its_attempts, expire_lease),
            sweep,
        ),
        ("lifecycle.sweep (message lost, re-sent)", lambda: age(new_task()), sweep),  # behind
        (
            "lifecycle.sweep (message lost, re-sent)",  # its message is gone: sent again
            lambda: (age(new_task()), empty_queue())[0],
            sweep,
        ),
        (
            "lifecycle.sweep (queued, model gone)",
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
        recorded = changes()
        assert recorded, f"{name}: no change recorded"
        transition = TRANSITIONS[name]
        for task_id, before, after, changed in recorded:
            assert transition.allows(before, after, changed), (
                f"{name} changed {task_id} {before} -> {after}, setting {sorted(changed)}"
            )
        made.add(name)
        # the next scenario starts alone: its claim takes its own task
        Task.objects.exclude(status__in=FINAL).update(status=Status.CANCELLED)
        OwnerQuota.objects.all().delete()
        changes()
    assert made == set(TRANSITIONS)


def test_a_change_outside_its_line_is_refused():
    claim = TRANSITIONS["lifecycle.claim"]
    assert claim.allows("queued", "in_progress", frozenset({"status", "attempt", "worker"}))
    assert not claim.allows("queued", "in_progress", frozenset({"status", "checkpoint"}))
    assert not claim.allows("failed", "in_progress", frozenset({"status"}))
    prune = TRANSITIONS["retention.prune_events"]
    assert not prune.allows("completed", "failed", frozenset({"status", "pruned_through"}))
    assert not prune.allows("completed", "completed", frozenset({"*"}))


# --- the writers of the task table, read from the code -------------------------------


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


def task_writers() -> set[str]:
    """``module.function`` (or ``module.CONSTANT``) of every statement of the
    service that writes task rows; modules of ``tasks_app`` by their short
    name, others by their dotted path."""
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
                    if any(_writes_tasks(n) for n in own if id(n) not in inner_defs):
                        found.add(f"{module}.{scope.name}")
            for statement in tree.body:
                if isinstance(statement, ast.Assign) and _writes_tasks(statement):
                    for target in statement.targets:
                        if isinstance(target, ast.Name):
                            found.add(f"{module}.{target.id}")
    return found


def test_the_table_names_every_writer_of_the_task_table():
    assert task_writers() == writers()
