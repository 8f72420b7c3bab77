"""Usage accounting at a request's end (``tasks_app.usage``): every way a
request ends completes its usage record and adds it, once, to its owner's
day; retries, stale attempts, hand-backs and re-runs never count it twice.
The lifecycle and the runner as plain functions: real PostgreSQL and the
real model, in this process."""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest
from django.apps import apps
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from lmsp_core.status import Status
from responses_app import records
from responses_app.models import Response
from responses_app.serializers import validate_response_request
from responses_app.submit import prepare_generation, start_generation
from tasks_app import checkpoints, claims, endings, lifecycle, usage
from tasks_app.models import DailyUsage, Task, TaskKind, UsageRecord
from tasks_app.signals import task_finished
from workers.runner import run_task

from .conftest import request_body
from .test_admin import make_response
from .test_lifecycle import checkpoint_of

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.model]

FIGURES = ("requests", "input_tokens", "output_tokens", "cached_tokens", "worker_seconds")


@pytest.fixture(autouse=True)
def private_queue(settings) -> None:
    """Only the runner called here generates these tests' tasks."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-in-process"


@pytest.fixture
def engine_seconds() -> list[float]:
    """The worker seconds each ending attempt measured, as the runner hands
    them to ``endings.finish`` (read from the ``task_finished`` signal)."""
    seen: list[float] = []

    def heard(sender, task, outcome, **kwargs) -> None:  # noqa: ANN001
        seen.append(outcome.worker_seconds)

    task_finished.connect(heard, weak=False)
    yield seen
    task_finished.disconnect(heard)


def new_task(username: str = "alice", **extra) -> Task:
    owner, _ = get_user_model().objects.get_or_create(username=username)
    prepared = prepare_generation(owner, validate_response_request(request_body(**extra)))
    return start_generation(owner, prepared, TaskKind.TASK)


def day_of(task: Task) -> dict:
    """The owner's one DailyUsage row for the task's model and day."""
    record = UsageRecord.objects.get(response_id=task.response_id)
    row = DailyUsage.objects.get(
        owner_id=task.owner_id, model=task.model, day=record.created_at.date()
    )
    return {name: getattr(row, name) for name in FIGURES}


def as_day(*records: UsageRecord) -> dict:
    return {
        "requests": len(records),
        **{name: sum(getattr(r, name) for r in records) for name in FIGURES[1:]},
    }


def test_a_run_completes_its_record_and_adds_it_to_its_day_once(engine_seconds):
    task = new_task(max_output_tokens=8)
    assert run_task(task.id, "w1") in ("completed", "incomplete")
    task.refresh_from_db()
    record = UsageRecord.objects.get(response_id=task.response_id)
    assert record.status == task.status and record.completed_at == task.completed_at
    assert record.output_tokens == task.response.output_tokens > 0
    assert record.input_tokens == task.response.input_tokens
    # the attempt's time in the engine, exactly as measured: within its claim and its end
    assert record.worker_seconds == engine_seconds[0]
    assert 0 < record.worker_seconds < (task.completed_at - task.started_at).total_seconds()
    assert day_of(task) == as_day(record)
    # a redelivered message, a stale attempt's finish and a second end change nothing
    assert run_task(task.id, "late-redelivery") is None
    outcome = endings.Outcome(status=Status.COMPLETED, output_tokens=99, cached_tokens=99)
    assert endings.finish(task.id, task.attempt, [], outcome) is False
    usage.end(
        task.response_id,
        Status.COMPLETED,
        output_tokens=99,
        cached_tokens=99,
        worker_seconds=99.0,
        now=task.completed_at,
    )
    assert UsageRecord.objects.get(response_id=task.response_id) == record
    assert day_of(task) == as_day(record)


def test_the_same_prompt_again_reports_the_prefix_cache_s_tokens():
    first, second = new_task(max_output_tokens=4), new_task(max_output_tokens=4)
    run_task(first.id, "w1")
    run_task(second.id, "w1")
    records_ = [UsageRecord.objects.get(response_id=t.response_id) for t in (first, second)]
    assert 0 < records_[1].cached_tokens < records_[1].input_tokens
    assert day_of(first) == as_day(*records_)


def test_a_cancel_while_queued_counts_the_request_with_no_output_and_no_worker_time():
    task = new_task()
    lifecycle.request_cancel(task.id)
    record = UsageRecord.objects.get(response_id=task.response_id)
    assert (record.status, record.output_tokens, record.worker_seconds) == ("cancelled", 0, 0)
    assert day_of(task) == as_day(record) and day_of(task)["requests"] == 1


def test_a_handed_back_task_is_counted_once_when_it_ends(engine_seconds):
    task = new_task(max_output_tokens=8)
    claimed = claims.claim(task.id, "w1")
    flush = checkpoints.Flush(task.id, claimed.attempt, [], [], checkpoint_of(task, tokens=0))
    assert checkpoints.hand_back(flush, worker_seconds=2.5)
    assert not DailyUsage.objects.exists()  # not ended: not counted yet
    assert UsageRecord.objects.get(response_id=task.response_id).worker_seconds == 2.5
    assert run_task(task.id, "w2") in ("completed", "incomplete")
    record = UsageRecord.objects.get(response_id=task.response_id)
    assert day_of(task) == as_day(record) and day_of(task)["requests"] == 1
    # the handed-back attempt's time, and the last one's, exactly
    assert engine_seconds[0] > 0
    assert record.worker_seconds == 2.5 + engine_seconds[0]


def test_a_failed_task_run_again_counts_as_its_new_run_only():
    task = new_task(max_output_tokens=8)
    task.response.params["temperature"] = "hot"  # the engine cannot sample with this
    task.response.save()
    assert run_task(task.id, "w1") == "failed"
    assert day_of(task)["requests"] == 1
    Response.objects.filter(id=task.response_id).update(
        params={**task.response.params, "temperature": 0}
    )
    lifecycle.requeue_failed(task.id)
    assert day_of(task) == dict.fromkeys(FIGURES, 0)  # out of its day while it runs again
    assert UsageRecord.objects.get(response_id=task.response_id).status == "in_progress"
    assert run_task(task.id, "w2") in ("completed", "incomplete")
    record = UsageRecord.objects.get(response_id=task.response_id)
    assert record.output_tokens > 0 and day_of(task) == as_day(record)


def test_an_erased_running_task_ends_its_record_cancelled_with_its_checkpoint_s_tokens():
    task = new_task(store=True, max_output_tokens=8)
    claimed = claims.claim(task.id, "w1")
    checkpoints.record_progress(task.id, claimed.attempt, [], [5, 6], checkpoint_of(task, tokens=2))
    records.erase(Response.objects.filter(id=task.response_id))
    assert not Task.objects.filter(id=task.id).exists()
    record = UsageRecord.objects.get(response_id=task.response_id)
    assert (record.status, record.output_tokens) == ("cancelled", 2)
    assert day_of(task) == as_day(record)
    outcome = endings.Outcome(status=Status.COMPLETED, output_tokens=8)
    assert endings.finish(task.id, claimed.attempt, [], outcome) is False  # its worker, late
    assert day_of(task) == as_day(record)


def test_requests_of_two_owners_go_to_their_own_rows():
    mine, theirs = new_task(), new_task(username="bob")
    for task in (mine, theirs):
        lifecycle.request_cancel(task.id)
    assert DailyUsage.objects.count() == 2
    assert day_of(mine)["requests"] == day_of(theirs)["requests"] == 1


def test_the_migration_fills_worker_seconds_and_days_from_stored_records():
    """Records stored before ``DailyUsage`` existed: their days are built from
    the ended ones, their worker seconds from their tasks where those remain."""
    alice = get_user_model().objects.create_user("alice")
    bob = get_user_model().objects.create_user("bob")
    now = timezone.now().replace(hour=12)
    yesterday = now - timedelta(days=1)
    for owner, created, status in [
        (alice, now, "completed"),
        (alice, now, "failed"),
        (alice, now, "in_progress"),  # not ended: counted when it ends
        (alice, yesterday, "completed"),
        (bob, now, "cancelled"),
    ]:
        response = make_response(
            owner, [], status=status, created_at=created, started_at=created - timedelta(seconds=3)
        )
    Task.objects.filter(response=response).delete()  # bob's task is gone, its record stays
    fill = importlib.import_module("tasks_app.migrations.0008_fill_daily_usage").fill_daily_usage
    with connection.schema_editor() as editor:
        fill(apps, editor)
    days = {
        (row.owner.username, row.day): (row.requests, row.input_tokens, row.output_tokens)
        for row in DailyUsage.objects.select_related("owner")
    }
    assert days == {
        ("alice", now.date()): (2, 22, 14),
        ("alice", yesterday.date()): (1, 11, 7),
        ("bob", now.date()): (1, 11, 7),
    }
    seconds = sorted(UsageRecord.objects.values_list("owner__username", "status", "worker_seconds"))
    assert seconds == [
        ("alice", "completed", 3.0),
        ("alice", "completed", 3.0),
        ("alice", "failed", 3.0),
        ("alice", "in_progress", 0.0),
        ("bob", "cancelled", 0.0),
    ]
    assert DailyUsage.objects.get(owner=alice, day=now.date()).worker_seconds == 6.0
    with connection.schema_editor() as editor:
        fill(apps, editor)  # run again: the same days, not twice
    assert DailyUsage.objects.get(owner=alice, day=now.date()).requests == 2
