"""The task lifecycle and the runner as plain functions, without Celery:
real PostgreSQL and the real model, in this process."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.utils import timezone

from generation.output import OutputAssembler
from generation.params import GenerationParams
from generation.registry import get_model
from lmsp_core import protocol
from lmsp_core.errors import ProblemError
from lmsp_core.status import Status
from responses_app import records
from responses_app.models import Response
from responses_app.serializers import validate_response_request
from responses_app.submit import prepare_generation, start_generation
from tasks_app import checkpoints, claims, endings, lifecycle, sweeper
from tasks_app.models import Event, Task, TaskKind, TokenChunk
from tasks_app.notify import CANCEL_CHANNEL
from workers import runner as runner_module
from workers.cancellation import CancelWatch
from workers.runner import run_task

from .conftest import LONG_STORY, make_token, request_body, user_message

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def private_queue(settings) -> None:
    """Jobs of these tests go to a queue no worker of the test stack serves,
    so that only the runner called here generates them."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-in-process"


def new_task(**extra) -> Task:
    owner, _ = get_user_model().objects.get_or_create(username="alice")
    prepared = prepare_generation(owner, validate_response_request(request_body(**extra)))
    return start_generation(owner, prepared, TaskKind.TASK)


def events_of(task: Task) -> list[tuple[int, str, dict]]:
    rows = Event.objects.filter(task=task).order_by("seq").values_list("seq", "type", "data")
    return [(seq, name, json.loads(data)) for seq, name, data in rows]


@pytest.mark.model
def test_run_task_writes_one_contiguous_log_and_the_result():
    task = new_task(max_output_tokens=12)
    assert run_task(task.id, "test-worker") in ("completed", "incomplete")
    task.refresh_from_db()
    response = task.response
    events = events_of(task)
    assert [seq for seq, _, _ in events] == list(range(1, task.last_event_id + 1))
    assert events[0][1] == "response.created" and events[-1][1] == f"response.{task.status}"
    text = "".join(d["delta"] for _, name, d in events if name == "response.output_text.delta")
    assert text == response.output[0]["content"][0]["text"]
    assert response.status == task.status and response.output_tokens > 0
    assert task.lease_expires_at is None and task.checkpoint is None and task.attempt == 1
    assert run_task(task.id, "late-redelivery") is None  # a second message is dropped


def test_a_worker_whose_attempt_was_superseded_cannot_write():
    task = new_task()
    claimed = claims.claim(task.id, "w1")
    Task.objects.filter(id=task.id).update(attempt=claimed.attempt + 1)  # handed on
    delta = ("response.output_text.delta", {"delta": "stale"})
    progress = checkpoints.record_progress(task.id, claimed.attempt, [delta], [], {})
    assert progress.owned is False
    assert claims.renew_lease(task.id, claimed.attempt) is False
    assert claims.renew_lease(task.id, claimed.attempt + 1) is True
    outcome = endings.Outcome(status=Status.COMPLETED)
    assert endings.finish(task.id, claimed.attempt, [delta], outcome) is False
    assert [name for _, name, _ in events_of(task)] == ["response.created"]
    assert Task.objects.get(id=task.id).status == Status.IN_PROGRESS


@pytest.mark.model
def test_cancel_flag_stops_the_run_at_its_first_step():
    task = new_task(max_output_tokens=50)
    Task.objects.filter(id=task.id).update(cancel_requested=True)  # as if asked mid-claim
    assert run_task(task.id, "w1") == "cancelled"
    task.refresh_from_db()
    assert task.status == Status.CANCELLED
    assert events_of(task)[-1][1] == "response.cancelled"


@pytest.mark.model
def test_an_announced_cancel_stops_the_run_before_its_next_flush(settings, broker, monkeypatch):
    """A cancel reaches the batch at once (``workers.cancellation``), not at
    the run's next flush: here the flushes after the first are a minute apart,
    longer than the whole generation, however slow its steps."""
    settings.LMSP_FLUSH_INTERVAL_SECONDS = 60
    monkeypatch.setattr(runner_module, "IDLE_FLUSH_SECONDS", 60)
    # A watch of its own: the process's watch was started by earlier tests
    # while no Redis ran here, and may be waiting out its reconnect back-off.
    monkeypatch.setattr(runner_module, "cancel_watch", CancelWatch())
    client, _ = broker
    task = new_task(input=[user_message(LONG_STORY)], max_output_tokens=400)
    ended: dict[str, str | None] = {}

    def run() -> None:
        try:
            ended["status"] = run_task(task.id, "w1")
        finally:
            connection.close()  # this thread's own

    runner = threading.Thread(target=run)
    runner.start()
    deadline = time.monotonic() + 120
    while not (
        Event.objects.filter(task=task, type="response.output_text.delta").exists()
        and dict(client.pubsub_numsub(CANCEL_CHANNEL))[CANCEL_CHANNEL.encode()]
    ):  # decoding, and the watch subscribed: the announcement has a listener
        assert runner.is_alive() and time.monotonic() < deadline, "no first token"
        time.sleep(0.02)
    lifecycle.request_cancel(task.id)
    runner.join(30)
    assert not runner.is_alive() and ended["status"] == "cancelled"
    task.refresh_from_db()
    assert task.status == Status.CANCELLED
    assert task.response.output_tokens < 400  # stopped, not run to its limit
    assert events_of(task)[-1][1] == "response.cancelled"


def test_flushes_of_several_runs_are_written_in_one_go_each_fenced_by_its_attempt(broker):
    """One statement, and one message for the web processes: a worker's
    flush of its batch wakes each of them once."""
    from tasks_app.models import TokenChunk
    from tasks_app.notify import CHANNEL

    tasks = [new_task(max_output_tokens=8) for _ in range(3)]
    claimed = [claims.claim(task.id, f"w{i}") for i, task in enumerate(tasks)]
    assert {c.id for c in claimed} == {t.id for t in tasks}
    handed_on = claimed[1]
    Task.objects.filter(id=handed_on.id).update(attempt=handed_on.attempt + 1)
    flushes = [
        checkpoints.Flush(
            c.id,
            c.attempt,
            [("response.output_text.delta", {"delta": f"row {i}"})],
            [100 + i, 200 + i],
            {"tokens": 2, "detokenizer": {}, "assembler": {}},
        )
        for i, c in enumerate(claimed)
    ]
    client, _ = broker
    listening = client.pubsub(ignore_subscribe_messages=True)
    listening.subscribe(CHANNEL)
    listening.get_message(timeout=1)  # the subscription's confirmation
    results = checkpoints.record_progress_many(flushes)
    assert [r.owned for r in results] == [True, False, True]
    messages = []
    while (message := listening.get_message(timeout=0.5)) is not None:
        messages.append(json.loads(message["data"]))
    listening.close()
    delta = "response.output_text.delta"
    assert messages == [
        {
            "tasks": {
                c.id: [[2, delta, protocol.dumps({"delta": f"row {i}"})]]
                for i, c in enumerate(claimed)
                if i != 1
            }
        }
    ]
    for i, c in enumerate(claimed):
        task = Task.objects.get(id=c.id)
        names = [name for _, name, _ in events_of(task)]
        chunks = list(TokenChunk.objects.filter(task=task).values_list("start", "token_ids"))
        if i == 1:  # fenced out: nothing written, nothing renewed
            assert names == ["response.created"] and chunks == [] and task.checkpoint is None
        else:
            assert names == ["response.created", "response.output_text.delta"]
            assert events_of(task)[-1][2] == {"delta": f"row {i}"}
            assert task.last_event_id == 2 and task.checkpoint["tokens"] == 2
            assert chunks == [(0, [100 + i, 200 + i])]


def test_flush_group_writes_concurrent_flushes_and_a_bad_one_fails_alone():
    """Flushes from many job threads at once (one batched worker) are grouped;
    every run's events stay contiguous, and a flush PostgreSQL refuses fails
    only its own run."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    from workers.flushing import FlushGroup

    group = FlushGroup()
    tasks = [new_task(max_output_tokens=8) for _ in range(6)]
    claimed = [claims.claim(task.id, f"w{i}") for i, task in enumerate(tasks)]

    def run(i: int) -> str:
        c = claimed[i]
        try:
            for step in range(5):
                # row 0's third flush holds a NUL in an event name: PostgreSQL refuses it
                name = "bad\x00name" if (i, step) == (0, 2) else "response.output_text.delta"
                progress = group.write(
                    checkpoints.Flush(
                        c.id,
                        c.attempt,
                        [(name, {"delta": str(step)})],
                        [step],
                        {"tokens": step + 1},
                    )
                )
                assert progress.owned
            return "ok"
        except Exception as exc:
            return type(exc).__name__
        finally:
            connection.close()

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(run, range(6)))
    assert outcomes[0] != "ok" and outcomes[1:] == ["ok"] * 5
    for i, c in enumerate(claimed):
        task = Task.objects.get(id=c.id)
        events = events_of(task)
        assert [seq for seq, _, _ in events] == list(range(1, task.last_event_id + 1))
        deltas = [d["delta"] for _, name, d in events if name == "response.output_text.delta"]
        assert deltas == (["0", "1"] if i == 0 else ["0", "1", "2", "3", "4"])


def test_an_empty_flush_does_not_hold_back_the_decoding_runs_flushes():
    """A run waiting for its first token flushes now and then with nothing to
    write (to notice a cancel); the worker's flush interval, which the
    decoding runs wait for, starts again only at a write that carries events
    or tokens, or an idle run beside them would keep their text back."""
    from workers.flushing import FlushGroup

    group = FlushGroup()
    waiting, decoding = (claims.claim(new_task().id, f"w{i}") for i in range(2))
    assert group.due(60)
    assert group.write(checkpoints.Flush(waiting.id, waiting.attempt, [], [], {"tokens": 0})).owned
    assert group.due(60)
    delta = [("response.output_text.delta", {"delta": "a"})]
    flush = checkpoints.Flush(decoding.id, decoding.attempt, delta, [5], {"tokens": 1})
    assert group.write(flush).owned
    assert not group.due(60)


def test_expired_leases_are_requeued_until_attempts_run_out(settings):
    settings.LMSP_MAX_ATTEMPTS = 2
    task = new_task()
    for attempt in (1, 2):
        claimed = claims.claim(task.id, f"w{attempt}")
        assert claimed.attempt == attempt
        Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(1))
        report = sweeper.sweep()
        if attempt == 1:
            assert report.requeued == [task.id]
            assert Task.objects.get(id=task.id).status == Status.QUEUED
    assert report.ended == [task.id]
    task.refresh_from_db()
    assert task.status == Status.FAILED and task.error["code"] == "worker_lost"
    assert task.response.status == "failed" and task.response.error == task.error
    name, data = events_of(task)[-1][1:]
    assert name == "response.failed" and data["error"]["code"] == "worker_lost"


@pytest.mark.model
def test_a_generation_error_fails_the_task_with_a_problem():
    task = new_task()
    task.response.params["temperature"] = "hot"  # the engine cannot sample with this
    task.response.save()
    assert run_task(task.id, "w1") == "failed"
    task.refresh_from_db()
    assert task.error["code"] == "generation_failed" and task.error["status"] == 502
    assert events_of(task)[-1][1] == "response.failed"


def test_a_full_queue_refuses_new_work_with_503(settings, client):
    settings.LMSP_MAX_QUEUED_PER_MODEL = 1
    new_task()
    with pytest.raises(ProblemError) as refused:
        new_task()
    assert refused.value.code == "overloaded" and refused.value.status == 503
    answer = client.post(
        "/lmsp/v1/tasks",
        {"type": "response", "request": request_body()},
        content_type="application/json",
        headers={"Authorization": f"Bearer {make_token('bob')}"},
    )
    assert answer.status_code == 503 and answer["Retry-After"] == "10"
    assert answer["Content-Type"] == "application/problem+json"
    assert answer.json()["code"] == "overloaded"
    assert Task.objects.count() == 1


def test_concurrent_claims_each_take_a_different_task_in_fair_order():
    """Many jobs claiming at once (threads of one batched worker, or workers on
    several machines) never share a task, and together take the fairest ones."""
    from concurrent.futures import ThreadPoolExecutor

    from django.db import connection

    tasks = [new_task(max_output_tokens=4) for _ in range(6)]
    bob, _ = get_user_model().objects.get_or_create(username="bob")
    prepared = prepare_generation(bob, validate_response_request(request_body()))
    newcomer = start_generation(bob, prepared, TaskKind.TASK)

    def claim(i: int) -> str | None:
        try:
            claimed = claims.claim(tasks[-1].id, f"w{i}")
            return claimed.id if claimed else None
        finally:
            connection.close()

    with ThreadPoolExecutor(4) as pool:
        taken = list(pool.map(claim, range(4)))
    assert None not in taken and len(set(taken)) == 4
    # alice's first three (fair keys 0, 4, 8) and bob's one (key 0), whatever the message
    assert set(taken) == {tasks[0].id, tasks[1].id, tasks[2].id, newcomer.id}


@pytest.mark.parametrize("running_limit", [0, 1])
def test_a_message_whose_task_is_gone_claims_for_its_model(settings, running_limit):
    """A message is a slot for the model it names: its own task may have been
    claimed through another message, ended and been discarded before it is
    taken (seen in bench_concurrency: 16 direct requests on 8 slots, one left
    queued), and it then claims the model's next task. Both claim paths."""
    settings.LMSP_QUOTA_MAX_RUNNING = running_limit
    first, second = new_task(), new_task()
    assert claims.claim(second.id, "w1", first.model).id == first.id
    claimed = Task.objects.get(id=first.id)
    assert endings.finish(first.id, claimed.attempt, [], endings.Outcome(Status.COMPLETED))
    claimed.response.delete()  # discarded, with its task
    assert claims.claim(first.id, "w2", first.model).id == second.id


def test_an_owner_at_its_running_quota_waits_until_a_generation_ends(settings):
    """A claim takes the fairest task, not the one its message names; an owner
    at its running quota is passed over until one of its generations ends."""
    settings.LMSP_QUOTA_MAX_RUNNING = 1
    first, second = new_task(), new_task()  # alice's backlog
    bob, _ = get_user_model().objects.get_or_create(username="bob")
    prepared = prepare_generation(bob, validate_response_request(request_body()))
    newcomer = start_generation(bob, prepared, TaskKind.TASK)
    assert claims.claim(second.id, "w1").id == first.id  # whatever the message names
    assert claims.claim(first.id, "w2").id == newcomer.id  # bob before alice's second
    assert claims.claim(first.id, "w3") is None  # alice has one running: her quota
    claimed = Task.objects.get(id=first.id)
    outcome = endings.Outcome(status=Status.INCOMPLETE)
    assert endings.finish(first.id, claimed.attempt, [], outcome)
    assert claims.claim(first.id, "w4").id == second.id


@pytest.mark.parametrize("running_limit", [0, 1])
def test_a_job_sent_to_a_worker_for_its_task_claims_that_task_first(settings, running_limit):
    """A conversation's next turn sent to the worker that holds the
    conversation is claimed there before fairer tasks; a spare job of that
    kind, its task gone, is a plain slot. Both claim paths."""
    settings.LMSP_QUOTA_MAX_RUNNING = running_limit
    fairer, follow_up = new_task(), new_task()
    claimed = claims.claim(follow_up.id, "w1", follow_up.model, preferred=follow_up.id)
    assert claimed.id == follow_up.id
    outcome = endings.Outcome(status=Status.INCOMPLETE)
    assert endings.finish(follow_up.id, claimed.attempt, [], outcome)
    again = claims.claim(follow_up.id, "w2", follow_up.model, preferred=follow_up.id)
    assert again.id == fairer.id


def test_a_handed_back_task_is_queued_again_first_and_keeps_its_attempts(settings):
    """Handing back (the engine needed the memory) writes the last flush and
    queues the task again at once, with its fair key: it is claimed before a
    task queued after it, and resumes from its checkpoint. It is no lost
    attempt: the sweeper's count of attempts does not grow with it."""
    settings.LMSP_MAX_ATTEMPTS = 2
    task, later = new_task(), new_task()
    claimed = claims.claim(task.id, "w1")
    assert claimed.id == task.id
    checkpoint = checkpoint_of(task, tokens=2)
    flush = checkpoints.Flush(task.id, claimed.attempt, [], [5, 6], checkpoint)
    assert checkpoints.hand_back(flush)
    task.refresh_from_db()
    assert (task.status, task.worker, task.handed_back) == (Status.QUEUED, "", 1)
    assert task.checkpoint == checkpoint and endings.restore(task).token_ids == [5, 6]
    assert not checkpoints.hand_back(flush)  # that attempt owns nothing any more
    again = claims.claim(later.id, "w2")
    assert again.id == task.id and again.attempt == 2
    Task.objects.filter(id=task.id).update(lease_expires_at=timezone.now() - timedelta(1))
    # one attempt lost of two claimed: not yet LMSP_MAX_ATTEMPTS lost
    assert sweeper.sweep().requeued == [task.id]


def test_a_cancel_asked_while_a_task_was_running_ends_it_when_handed_back():
    task = new_task()
    claimed = claims.claim(task.id, "w1")
    lifecycle.request_cancel(task.id)
    flush = checkpoints.Flush(task.id, claimed.attempt, [], [], checkpoint_of(task, tokens=0))
    assert checkpoints.hand_back(flush)
    task.refresh_from_db()
    assert task.status == Status.CANCELLED
    assert events_of(task)[-1][1] == "response.cancelled"


def checkpoint_of(task: Task, tokens: int) -> dict:
    """A run's checkpoint after ``tokens`` tokens that made no text yet."""
    assembler = OutputAssembler.for_generation(
        task.response_id, GenerationParams(), get_model(task.model)
    )
    return {
        "tokens": tokens,
        "detokenizer": {"prefix": 0, "read": 0},
        "assembler": assembler.compact_state(),
    }


def test_a_follow_up_is_sent_to_the_worker_that_ran_the_turn_before_while_it_has_room(broker):
    from tasks_app import heartbeat, routing

    first = new_task(store=True)
    spec = get_model(first.model)
    assert routing.queue_for(spec, None) == (spec.queue, False)
    assert routing.queue_for(spec, first.response_id) == (spec.queue, False)  # never ran
    Task.objects.filter(id=first.id).update(worker="models-1@elsewhere")
    assert routing.queue_for(spec, first.response_id) == (spec.queue, False)  # no heartbeat
    try:
        heartbeat.beat([spec.id], "models-1@elsewhere", lambda model: {"free_slots": 1})
        assert routing.queue_for(spec, first.response_id) == (
            spec.worker_queue("models-1@elsewhere"),
            True,
        )
        heartbeat.beat([spec.id], "models-1@elsewhere", lambda model: {"free_slots": 0})
        assert routing.queue_for(spec, first.response_id) == (spec.queue, False)  # full
    finally:
        heartbeat.forget([spec.id], "models-1@elsewhere")


def test_a_previous_response_deleted_before_its_follow_up_is_stored_is_404():
    """Between the follow-up's lookup of its previous response and its insert,
    the previous one is erased (``DELETE /responses/{id}``): 404, not 500."""
    first = new_task(store=True)
    owner = first.owner
    request = validate_response_request(
        request_body("More?", previous_response_id=first.response_id)
    )
    prepared = prepare_generation(owner, request)
    Response.objects.filter(id=first.response_id).delete()
    with pytest.raises(ProblemError) as refused:
        start_generation(owner, prepared, TaskKind.TASK)
    assert refused.value.code == "response_not_found"
    assert refused.value.param == "previous_response_id"


def test_a_delivered_direct_answer_goes_whole_unless_a_later_turn_points_to_it():
    """``records.discard_delivered`` deletes in one statement what Django's
    cascade deleted (the task, its events and token chunks); a response a
    later turn points to (only a stored one can be continued, so this is a
    row written by hand) is left to the pruner, which empties the pointer."""
    owner, _ = get_user_model().objects.get_or_create(username="alice")

    def ended_direct_answer() -> Task:
        prepared = prepare_generation(owner, validate_response_request(request_body()))
        task = start_generation(owner, prepared, TaskKind.DIRECT)
        TokenChunk.objects.create(task_id=task.id, start=0, token_ids=[1, 2])
        Task.objects.filter(id=task.id).update(status=Status.COMPLETED, completed_at=timezone.now())
        return task

    delivered, pointed_to, later = (ended_direct_answer() for _ in range(3))
    Response.objects.filter(id=later.response_id).update(previous_response=pointed_to.response_id)

    assert records.discard_delivered(delivered.id)
    assert not Response.objects.filter(id=delivered.response_id).exists()
    assert not Task.objects.filter(id=delivered.id).exists()
    assert not Event.objects.filter(task_id=delivered.id).exists()
    assert not TokenChunk.objects.filter(task_id=delivered.id).exists()

    assert not records.discard_delivered(pointed_to.id)
    assert Event.objects.filter(task_id=pointed_to.id).exists()
    Task.objects.filter(id=pointed_to.id).update(
        completed_at=timezone.now() - records.UNDELIVERED_GRACE - timedelta(seconds=1)
    )
    records.discard_unneeded()
    assert not Response.objects.filter(id=pointed_to.response_id).exists()
    assert Response.objects.get(id=later.response_id).previous_response_id is None


def test_the_one_statement_discard_knows_every_relation_of_a_task_and_a_response():
    """``records.discard_delivered`` names by hand what Django's cascade would
    delete: a relation added to ``Task`` or ``Response`` later must be
    deleted there too (or the answer kept out of it), else its foreign key
    fails the statement at commit."""
    sql = " ".join(records._DISCARD_DELIVERED_SQL.split())
    for model in (Task, Response):
        for relation in model._meta.related_objects:
            table, column = relation.related_model._meta.db_table, relation.field.column
            deleted = f"DELETE FROM {table} WHERE" in sql
            kept_out = f"NOT EXISTS (SELECT FROM {table} AS" in sql and column in sql
            assert deleted or kept_out, f"{table}.{column} is not in the discard statement"
