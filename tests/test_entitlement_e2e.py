"""A task runs only while it may (``tasks_app.entitlement``): its token
usable, its owner active, its model allowed. Tasks left waiting when one of
them is taken away end failed, saying why, never run and never billed; an
operator's re-queue asks the same.

The revoked token's tasks go through the whole stack (HTTP, the model
worker); the other cases call the worker's own entry point (``run_task``)
in this process, as ``test_lifecycle`` does."""

from __future__ import annotations

import time

import pytest
from django.contrib.auth import get_user_model

from accounts_app.models import ApiToken
from accounts_app.services import create_token, revoke_token
from lmsp_core.errors import ProblemError
from lmsp_core.status import FINAL_STATUSES, Status
from responses_app.serializers import validate_response_request
from responses_app.submit import submit
from tasks_app import lifecycle
from tasks_app.models import DailyUsage, Event, OwnerQuota, Task, TaskKind, TokenChunk, UsageRecord
from workers.runner import run_task

from .conftest import ALL_SCOPES, request_body

pytestmark = pytest.mark.django_db(transaction=True)

MODEL = "smollm2:135m"


def post_task(client) -> str:  # noqa: ANN001
    body = {"type": "response", "request": request_body(max_output_tokens=4)}
    answer = client.post("/lmsp/v1/tasks", json=body)
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def wait_final(task_ids: list[str], timeout: float = 300) -> list[Task]:
    deadline = time.monotonic() + timeout
    while Task.objects.filter(id__in=task_ids).exclude(status__in=FINAL_STATUSES).exists():
        assert time.monotonic() < deadline, "tasks still unfinished"
        time.sleep(0.5)
    return list(Task.objects.filter(id__in=task_ids).select_related("response"))


def assert_ended_unrun(task: Task, code: str, why: str) -> None:
    """Failed with the reason, nothing generated, nothing billed."""
    assert task.status == Status.FAILED, (task.id, task.status)
    assert task.error["code"] == code and why in task.error["detail"], task.error
    assert task.attempt == 0 and task.started_at is None  # never claimed
    events = list(Event.objects.filter(task=task).order_by("seq").values_list("type", flat=True))
    assert events == ["response.created", "response.failed"]
    assert not TokenChunk.objects.filter(task=task).exists()
    assert task.response.output_tokens == 0 and task.response.output == []
    record = UsageRecord.objects.get(response_id=task.response_id)
    assert (record.status, record.input_tokens, record.output_tokens) == ("failed", 0, 0)


def billed(username: str) -> tuple[int, int]:
    days = DailyUsage.objects.filter(owner__username=username)
    return (
        sum(day.input_tokens for day in days),
        sum(day.output_tokens for day in days),
    )


@pytest.mark.e2e
def test_twenty_queued_tasks_of_a_revoked_token_never_run(stack, restart_after):
    revoked = create_token(username="revoked-owner", scopes=ALL_SCOPES)
    bystander = create_token(username="bystander", scopes=ALL_SCOPES)
    stack.pause_worker()  # nothing is claimed: the tasks wait in the queue
    try:
        with stack.client(revoked.secret) as client:
            queued = [post_task(client) for _ in range(20)]
        with stack.client(bystander.secret) as client:
            other = post_task(client)  # behind them, of a token still valid
        assert revoke_token(revoked.secret) == 1
    finally:
        stack.resume_worker()
    tasks = wait_final([*queued, other])
    for task in tasks:
        if task.id == other:
            assert task.status in ("completed", "incomplete")  # the worker ran meanwhile
        else:
            assert_ended_unrun(task, "unauthorized", "revoked")
    assert billed("revoked-owner") == (0, 0)
    with pytest.raises(ProblemError, match="revoked"):  # the admin's re-queue
        lifecycle.requeue_failed(queued[0])
    assert Task.objects.get(id=queued[0]).status == Status.FAILED


# --- in this process -------------------------------------------------------------------


@pytest.fixture
def private_queue(settings) -> None:  # noqa: ANN001
    """Jobs go to a queue no worker of the test stack serves, so that only the
    runner called here takes them (as test_lifecycle)."""
    settings.LMSP_QUEUE_PREFIX = "lmsp.test-entitlement"


def queued_task(token: ApiToken) -> Task:
    request = validate_response_request(request_body(max_output_tokens=4))
    return submit(
        token.owner,
        request,
        kind=TaskKind.TASK,
        idempotency_key=None,
        allowed_models=None,
        token_id=token.pk,
    )


def test_a_deactivated_owners_queued_task_never_runs(private_queue):
    token = create_token(username="leaving", scopes=ALL_SCOPES).token
    task = queued_task(token)
    owner = get_user_model().objects.get(username="leaving")
    owner.is_active = False
    owner.save()
    assert run_task(task.id, "test-worker") is None  # the worker's claim takes nothing
    task.refresh_from_db()
    assert_ended_unrun(task, "unauthorized", "deactivated")
    assert billed("leaving") == (0, 0)
    with pytest.raises(ProblemError, match="deactivated"):
        lifecycle.requeue_failed(task.id)


@pytest.mark.parametrize("narrowed", ["owner", "token"])
def test_a_queued_task_whose_model_is_no_longer_allowed_never_runs(private_queue, narrowed):
    token = create_token(username="narrowed", scopes=ALL_SCOPES).token
    task = queued_task(token)
    if narrowed == "owner":
        OwnerQuota.objects.update_or_create(
            owner=token.owner, defaults={"allowed_models": ["another:1b"]}
        )
    else:
        ApiToken.objects.filter(pk=token.pk).update(allowed_models=["another:1b"])
    assert run_task(task.id, "test-worker") is None
    task.refresh_from_db()
    assert_ended_unrun(task, "model_not_found", "no longer allowed")
    assert task.error["model"] == MODEL
    with pytest.raises(ProblemError, match="no longer allowed"):
        lifecycle.requeue_failed(task.id)
    # allowed again: the operator's re-queue runs it
    OwnerQuota.objects.filter(owner=token.owner).update(allowed_models=None)
    ApiToken.objects.filter(pk=token.pk).update(allowed_models=None)
    lifecycle.requeue_failed(task.id)
    assert run_task(task.id, "test-worker") in ("completed", "incomplete")
