"""The Django admin: every page and action, through the test client on PostgreSQL."""

from __future__ import annotations

import re
import time
from datetime import timedelta

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth import get_user_model
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from accounts_app.models import SCOPES, ApiToken
from accounts_app.services import authenticate_bearer, issue_token
from lmsp_core import protocol
from lmsp_core.errors import problem
from lmsp_core.ids import new_id
from lmsp_core.redis_client import redis_client
from lmsp_core.status import Status
from responses_app.models import Response
from tasks_app import checkpoints, claims, heartbeat, jobs
from tasks_app.event_log import EventLog
from tasks_app.models import Event, Task, UsageRecord


def change_url(obj) -> str:
    """The admin's own link to an object: ids like ``resp_...`` are quoted in it."""
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)])


def message(role: str, text: str) -> dict:
    part = "output_text" if role == "assistant" else "input_text"
    return {"type": "message", "role": role, "content": [{"type": part, "text": text}]}


def make_response(
    owner,
    input_items: list[dict],
    output: list[dict] | None = None,
    *,
    status: str = "completed",
    model: str = "smollm2:135m",
    previous: Response | None = None,
    task_status: str | None = None,
    events: list[tuple[str, dict]] | None = None,
    created_at=None,
    **task_fields: object,
) -> Response:
    """A stored response and its task with a short event log, as a worker leaves them."""
    now = created_at or timezone.now()
    response = Response.objects.create(
        id=new_id("resp"),
        owner=owner,
        model=model,
        status=status,
        input=input_items,
        output=output or [],
        store=True,
        previous_response=previous,
        input_tokens=11,
        output_tokens=7,
        created_at=now,
        completed_at=None if status == "in_progress" else now,
        error=protocol_error() if status == "failed" else None,
    )
    task = Task.objects.create(
        id=new_id("task"),
        owner=owner,
        response=response,
        model=model,
        status=task_status or status,
        created_at=now,
        enqueued_at=now,
        completed_at=None if (task_status or status) in ("queued", "in_progress") else now,
        error=protocol_error() if (task_status or status) == "failed" else None,
        **task_fields,
    )
    with transaction.atomic():
        EventLog.append(task, events or [protocol.created_event(response.id)])
        task.save(update_fields=["last_event_id"])
    UsageRecord.objects.create(
        response_id=response.id,
        owner=owner,
        model=model,
        kind=task.kind,
        status=task.status,
        input_tokens=response.input_tokens,
        output_tokens=response.output_tokens,
        created_at=now,
        completed_at=task.completed_at,
    )
    return response


def protocol_error() -> dict:
    return problem("worker_lost", "The worker running this task was lost 3 times; giving up.")


@pytest.fixture
def alice(db):
    return get_user_model().objects.create_user("alice")


@pytest.fixture
def conversation(alice) -> tuple[Response, Response]:
    """Two turns: a tool call and its result in the second, reasoning in the first."""
    first = make_response(
        alice,
        [message("system", "You are terse."), message("user", "What is the weather in Oslo?")],
        [
            {
                "id": new_id("rs"),
                "type": "reasoning",
                "summary": [{"type": "summary_text", "text": "I need the weather tool."}],
            },
            protocol.function_call_item(new_id("fc"), "call_1", "get_weather", '{"city":"Oslo"}'),
        ],
        events=[
            protocol.created_event("resp_x"),
            protocol.text_delta_event("resp_x", "msg_x", "Hel"),
        ],
    )
    second = make_response(
        alice,
        [
            {
                "type": "function_call_output",
                "call_id": "call_1",
                "output": '{"temperature_c":17,"condition":"light rain"}',
            }
        ],
        [protocol.message_item(new_id("msg"), "It is 17 degrees with light rain in Oslo.")],
        previous=first,
    )
    return first, second


# --- the index and the login -----------------------------------------------------------


def test_index_links_the_dashboard_and_the_models(admin_client):
    page = admin_client.get("/admin/")
    assert page.status_code == 200
    html = page.content.decode()
    for link in (
        "/admin/lmsp/dashboard/",
        "/admin/lmsp/models/",
        "/admin/responses_app/response/",
        "/admin/tasks_app/task/",
        "/admin/accounts_app/apitoken/",
    ):
        assert link in html


@pytest.mark.parametrize(
    "path",
    ["/admin/lmsp/dashboard/", "/admin/lmsp/models/", "/admin/responses_app/response/"],
)
def test_pages_need_a_staff_login(client, alice, path):
    assert client.get(path).status_code == 302
    client.force_login(alice)  # not staff
    answer = client.get(path)
    assert answer.status_code == 302 and "/admin/login/" in answer["Location"]


def test_admin_static_files_are_served(client):
    answer = client.get("/static/admin/css/base.css")
    assert answer.status_code == 200
    assert b"".join(answer.streaming_content)


# --- responses -------------------------------------------------------------------------------


def test_response_list_shows_the_columns(admin_client, conversation):
    page = admin_client.get("/admin/responses_app/response/")
    assert page.status_code == 200
    html = page.content.decode()
    for response in conversation:
        assert response.id in html
    assert "alice" in html and "smollm2:135m" in html
    for column in ("column-tokens_in", "column-tokens_out", "column-created_at"):
        assert column in html


def test_response_list_filters(admin_client, alice, conversation):
    bob = get_user_model().objects.create_user("bob")
    failed = make_response(bob, [message("user", "boom")], status="failed", model="other:1b")
    old = make_response(
        bob, [message("user", "ancient")], created_at=timezone.now() - timedelta(days=40)
    )
    url = "/admin/responses_app/response/"

    def ids(query: dict) -> set[str]:
        html = admin_client.get(url, query).content.decode()
        return set(re.findall(r"resp_[0-9A-Z]{26}", html)) & {
            failed.id,
            old.id,
            *(r.id for r in conversation),
        }

    assert ids({"status__exact": "failed"}) == {failed.id}
    assert ids({"model": "other:1b"}) == {failed.id}
    assert ids({"owner__id__exact": alice.pk}) == {r.id for r in conversation}
    since = (timezone.now() - timedelta(days=7)).isoformat()
    assert old.id not in ids({"created_at__gte": since})
    assert failed.id in ids({"created_at__gte": since})


def test_response_search_by_id_and_by_text(admin_client, conversation):
    first, second = conversation
    url = "/admin/responses_app/response/"
    by_id = admin_client.get(url, {"q": second.id}).content.decode()
    assert second.id in by_id and f">{first.id}<" not in by_id
    by_input = admin_client.get(url, {"q": "weather in oslo"}).content.decode()
    assert f">{first.id}<" in by_input and f">{second.id}<" not in by_input
    by_output = admin_client.get(url, {"q": "light rain in Oslo"}).content.decode()
    assert f">{second.id}<" in by_output


def test_response_page_shows_the_whole_conversation_in_order(admin_client, conversation):
    first, second = conversation
    page = admin_client.get(change_url(second))
    assert page.status_code == 200
    html = page.content.decode()
    chat = html[html.index('id="conversation"') : html.index('id="timeline"')]
    expected = [
        "You are terse.",
        "What is the weather in Oslo?",
        "I need the weather tool.",
        "get_weather",
        "call_1",
        "&quot;city&quot;: &quot;Oslo&quot;",  # arguments, indented JSON
        "&quot;temperature_c&quot;: 17",
        "It is 17 degrees with light rain in Oslo.",
    ]
    positions = [chat.index(text) for text in expected]
    assert positions == sorted(positions)
    assert chat.index(first.id) < chat.index(second.id)
    for kind in (
        'data-kind="reasoning"',
        'data-kind="function_call"',
        'data-kind="function_call_output"',
        "lmsp-system",
        "lmsp-user",
        "lmsp-assistant",
    ):
        assert kind in chat
    # usage and the event timeline
    assert "Input tokens" in html and "11" in html
    assert "response.created" in html[html.index('id="timeline"') :]


def test_response_page_shows_error_and_delta_events(admin_client, conversation, alice):
    first, _ = conversation
    html = admin_client.get(change_url(first)).content.decode()
    assert "response.output_text.delta" in html and "&#x27;Hel&#x27;" in html
    failed = make_response(alice, [message("user", "boom")], status="failed")
    html = admin_client.get(change_url(failed)).content.decode()
    assert "worker_lost" in html


def test_response_pages_cannot_be_added_or_edited(admin_client, conversation):
    # Deleting is the one change allowed (issue 29: every stored word can be
    # erased): test_a_response_is_deleted_with_its_task_and_events.
    first, _ = conversation
    url = change_url(first)
    html = admin_client.get(url).content.decode()
    assert 'name="_save"' not in html
    assert admin_client.post(url, {"status": "failed"}).status_code == 403
    assert admin_client.get("/admin/responses_app/response/add/").status_code == 403
    first.refresh_from_db()
    assert first.status == "completed"


def test_a_response_is_deleted_with_its_task_and_events(admin_client, conversation):
    """The admin erases a response as DELETE /responses/{id} does: its task and
    events go; the later turn that continued from it stays, without it."""
    first, second = conversation
    task_id = first.task.id
    delete_url = change_url(first).replace("/change/", "/delete/")
    assert "deletelink" in admin_client.get(change_url(first)).content.decode()
    page = admin_client.get(delete_url)
    assert page.status_code == 200 and "Are you sure" in page.content.decode()
    assert admin_client.post(delete_url, {"post": "yes"}).status_code == 302
    assert not Response.objects.filter(pk=first.pk).exists()
    assert not Task.objects.filter(pk=task_id).exists()
    assert not Event.objects.filter(task_id=task_id).exists()
    second.refresh_from_db()
    assert second.previous_response is None and second.task.events.exists()
    # and the list's bulk action
    answer = admin_client.post(
        "/admin/responses_app/response/",
        {"action": "delete_selected", "_selected_action": [second.pk], "post": "yes"},
    )
    assert answer.status_code == 302 and not Response.objects.exists()
    assert not Task.objects.exists() and not Event.objects.exists()


# --- tasks ------------------------------------------------------------------------------------


def test_task_list_and_page_show_the_lifecycle(admin_client, conversation):
    task = conversation[0].task
    Task.objects.filter(pk=task.pk).update(attempt=2, pruned_through=1, worker="w@host:1")
    html = admin_client.get("/admin/tasks_app/task/").content.decode()
    assert task.id in html
    for column in (
        "column-attempt",
        "column-last_event_id",
        "column-pruned_through",
        "column-started_at",
        "column-completed_at",
    ):
        assert column in html
    page = admin_client.get(change_url(task))
    assert page.status_code == 200
    html = page.content.decode()
    assert "w@host:1" in html and 'name="_save"' not in html


def test_task_list_and_page_show_why_a_task_waits_for_its_upstream(admin_client, conversation):
    task = conversation[0].task
    reason = "the server is unreachable (ConnectError)"
    Task.objects.filter(pk=task.pk).update(waiting_reason=reason, waiting_since=timezone.now())
    html = admin_client.get("/admin/tasks_app/task/").content.decode()
    assert "column-waiting_reason" in html and reason in html
    page = admin_client.get(change_url(task)).content.decode()
    assert reason in page and "Waiting since" in page


def test_cancel_action_ends_a_queued_task(admin_client, alice):
    queued = make_response(
        alice, [message("user", "wait")], status="in_progress", task_status="queued"
    ).task
    done = make_response(alice, [message("user", "done")]).task
    answer = admin_client.post(
        "/admin/tasks_app/task/",
        {"action": "cancel_tasks", "_selected_action": [queued.id, done.id]},
        follow=True,
    )
    html = answer.content.decode()
    assert "Cancelled (or asked to stop) 1 task(s)." in html
    assert f"Task {done.id} is already completed." in html
    queued.refresh_from_db()
    assert queued.status == "cancelled"
    assert Event.objects.filter(task=queued, type="response.cancelled").exists()


def test_cancel_action_flags_a_running_task(admin_client, alice):
    running = make_response(
        alice, [message("user", "go")], status="in_progress", task_status="in_progress", attempt=1
    ).task
    admin_client.post(
        "/admin/tasks_app/task/", {"action": "cancel_tasks", "_selected_action": [running.id]}
    )
    running.refresh_from_db()
    assert running.status == "in_progress" and running.cancel_requested


def test_requeue_action_puts_a_failed_task_back_in_the_queue(
    admin_client, alice, django_capture_on_commit_callbacks, monkeypatch
):
    sent: list[tuple[str, str, str]] = []
    monkeypatch.setattr(jobs, "send_job", lambda *job: sent.append(job))
    failed = make_response(alice, [message("user", "boom")], status="failed", attempt=3).task
    Task.objects.filter(pk=failed.pk).update(worker="dead@host", checkpoint={"token_ids": [1]})
    done = make_response(alice, [message("user", "fine")]).task
    last = failed.last_event_id
    with django_capture_on_commit_callbacks(execute=True):
        answer = admin_client.post(
            "/admin/tasks_app/task/",
            {"action": "requeue_failed_tasks", "_selected_action": [failed.id, done.id]},
            follow=True,
        )
    html = answer.content.decode()
    assert "Re-queued 1 task(s)." in html
    assert f"Task {done.id} is completed; only a failed task can be re-queued." in html
    # once the reset is committed
    # to the model's queue, for any worker (not one worker's own: preferred False)
    assert sent == [(failed.id, "smollm2:135m", "lmsp.model.smollm2-135m", False, 0.0)]  # no delay
    failed.refresh_from_db()
    assert failed.status == Status.QUEUED
    assert failed.attempt == 3  # the fence: workers of attempts 1-3 stay locked out
    assert failed.error is None and failed.worker == "" and failed.checkpoint is None
    assert failed.completed_at is None
    assert failed.last_event_id == last + 1
    assert Event.objects.get(task=failed, seq=last + 1).type == "response.created"
    response = failed.response
    response.refresh_from_db()
    assert response.status == "in_progress" and response.error is None and response.output == []
    # a worker of the old attempt cannot write any more; the next claim takes attempt 4
    assert claims.claim(failed.id, "new@host").attempt == 4
    assert not checkpoints.record_progress(failed.id, 3, [], [], {}).owned


def test_tasks_cannot_be_added_edited_or_deleted(admin_client, conversation):
    task = conversation[0].task
    assert admin_client.get("/admin/tasks_app/task/add/").status_code == 403
    url = change_url(task)
    assert admin_client.post(url, {"status": "queued"}).status_code == 403
    assert admin_client.get(change_url(task).replace("/change/", "/delete/")).status_code == 403
    assert "deletelink" not in admin_client.get(url).content.decode()


# --- API tokens -------------------------------------------------------------------------------


def test_token_creation_shows_the_secret_once(admin_client, alice):
    form = admin_client.get("/admin/accounts_app/apitoken/add/").content.decode()
    for scope in SCOPES:
        assert f'type="checkbox" name="scopes" value="{scope}"' in form
    assert "tools:execute" not in form and "secret_hash" not in form
    answer = admin_client.post(
        "/admin/accounts_app/apitoken/add/",
        {
            "owner": alice.pk,
            "name": "ci",
            "scopes": ["models:read", "responses:read"],
            "expires_in_days": "30",
        },
    )
    assert answer.status_code == 200
    assert "no-store" in answer["Cache-Control"]
    html = answer.content.decode()
    [secret] = re.findall(r'value="(lmsp_[^"]+)"', html)
    token = ApiToken.objects.get()
    assert token.owner == alice and token.name == "ci"
    assert token.scopes == ["models:read", "responses:read"]
    assert timedelta(days=29) < token.expires_at - timezone.now() <= timedelta(days=30)
    assert token.secret_hash not in html
    assert authenticate_bearer(f"Bearer {secret}").pk == token.pk
    # never again: not on the list, not on its page
    pages = ("/admin/accounts_app/apitoken/", f"/admin/accounts_app/apitoken/{token.pk}/change/")
    for url in pages:
        html = admin_client.get(url).content.decode()
        assert secret not in html and token.secret_hash not in html
        assert token.prefix in html


def test_token_creation_needs_a_scope(admin_client, alice):
    answer = admin_client.post(
        "/admin/accounts_app/apitoken/add/", {"owner": alice.pk, "name": "none"}
    )
    assert answer.status_code == 200 and "This field is required." in answer.content.decode()
    assert not ApiToken.objects.exists()


def test_token_list_shows_last_use_and_revoke_action_revokes(admin_client, alice):
    used = issue_token(owner=alice, scopes=["models:read"], name="used")
    other = issue_token(owner=alice, scopes=["tasks:read"], name="other")
    authenticate_bearer(f"Bearer {used.secret}")
    used.token.refresh_from_db()
    html = admin_client.get("/admin/accounts_app/apitoken/").content.decode()
    assert "column-last_used_at" in html and "secret_hash" not in html
    admin_client.post(
        "/admin/accounts_app/apitoken/",
        {"action": "revoke", "_selected_action": [used.token.pk]},
    )
    used.token.refresh_from_db()
    other.token.refresh_from_db()
    assert used.token.revoked_at is not None and other.token.revoked_at is None
    html = admin_client.get("/admin/accounts_app/apitoken/?state=revoked").content.decode()
    assert used.token.prefix in html and other.token.prefix not in html


# --- models and heartbeats ------------------------------------------------------------------


@pytest.fixture
def own_redis(stack):
    """The test stack's Redis: settings point at it for the whole session."""
    yield
    heartbeat.forget(["smollm2:135m"], "models-test@host")


def test_models_page_shows_registry_and_who_serves_it(admin_client, own_redis):
    heartbeat.forget(["smollm2:135m"], "models-test@host")
    row = models_row(admin_client, "smollm2:135m")
    assert "tools, structured_output, conversations" in row
    assert "8192" in row and "4096" in row and "lmsp.model.smollm2-135m" in row
    assert "models-test@host" not in row
    heartbeat.beat(["smollm2:135m"], "models-test@host")
    assert "models-test@host" in models_row(admin_client, "smollm2:135m")
    assert 0 < redis_client().ttl(heartbeat._key("smollm2:135m", "models-test@host")) <= 15


def test_models_page_says_unknown_when_redis_is_down(admin_client, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    assert "unknown (Redis unreachable)" in models_row(admin_client, "smollm2:135m")


def test_heartbeat_thread_beats_and_clears_its_keys(own_redis):
    def beating_workers() -> list[str]:
        return [b.worker for b in heartbeat.serving_workers().get("smollm2:135m", [])]

    beating = heartbeat.Heartbeat(["smollm2:135m"], "models-test@host")
    beating.start()
    try:
        # The stack's model worker beats for the same model: wait for this one.
        for _ in range(50):
            if "models-test@host" in beating_workers():
                break
            time.sleep(0.1)
        assert "models-test@host" in beating_workers()
    finally:
        beating.stop()
    assert "models-test@host" not in beating_workers()


def models_row(admin_client, model_id: str) -> str:
    page = admin_client.get("/admin/lmsp/models/")
    assert page.status_code == 200
    html = page.content.decode()
    start = html.index(f'data-model="{model_id}"')
    return html[start : html.index("</tr>", start)]


# --- dashboard --------------------------------------------------------------------------------


def test_dashboard_draws_requests_tokens_queues_and_failures(admin_client, alice):
    make_response(alice, [message("user", "a")])
    make_response(alice, [message("user", "b")], model="other:1b")
    failed = make_response(alice, [message("user", "c")], status="failed").task
    make_response(alice, [message("user", "d")], status="in_progress", task_status="queued")
    make_response(alice, [message("user", "old")], created_at=timezone.now() - timedelta(days=2))
    page = admin_client.get("/admin/lmsp/dashboard/")
    assert page.status_code == 200
    html = page.content.decode()
    assert html.count('<svg class="lmsp-chart"') == 4
    for title in (
        "Requests per hour and model",
        "Tokens per model",
        "Queue depth per model",
        "Failed responses per hour",
    ):
        assert title in html
    table = html[html.index('id="requests"') : html.index('id="tokens"')]
    # smollm2: three in the window (one failed, one queued); the 2-day-old one not counted
    assert "<td>smollm2:135m</td><td>3</td><td>33</td><td>21</td><td>1</td>" in table
    assert "<td>other:1b</td><td>1</td>" in table
    queues = html[html.index('id="queues"') : html.index('id="failures"')]
    assert "smollm2:135m queued: 1" in queues
    failures = html[html.index('id="failures"') :]
    assert failed.id in failures and "worker_lost" in failures


def test_dashboard_escapes_model_names(admin_client, alice):
    make_response(alice, [message("user", "x")], model="<script>alert(1)</script>")
    html = admin_client.get("/admin/lmsp/dashboard/").content.decode()
    assert "<script>alert(1)</script>" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_dashboard_shows_the_queue_per_owner(admin_client, alice):
    make_response(alice, [message("user", "a")], status="in_progress", task_status="queued")
    make_response(alice, [message("user", "b")], status="in_progress", task_status="queued")
    make_response(alice, [message("user", "c")], status="in_progress", task_status="in_progress")
    html = admin_client.get("/admin/lmsp/dashboard/").content.decode()
    owners = html[html.index('id="owners"') : html.index('id="failures"')]
    user_url = reverse("admin:auth_user_change", args=[alice.pk])
    assert f'<a href="{user_url}">alice</a></td><td>2</td><td>1</td><td>1</td>' in owners


def quota_form(owner, **quota: object) -> dict:  # noqa: ANN001 - a User
    """The user page's form with the owner's quota inline set to ``quota``."""
    form: dict[str, object] = {
        "username": owner.username,
        "date_joined_0": "2026-01-01",
        "date_joined_1": "00:00:00",
        "is_active": "on",
        "quota-TOTAL_FORMS": "1",
        "quota-INITIAL_FORMS": "0",
        "quota-MIN_NUM_FORMS": "0",
        "quota-MAX_NUM_FORMS": "1",
        "quota-0-owner": str(owner.pk),
    }
    form.update({f"quota-0-{name}": value for name, value in quota.items()})
    return form


def test_user_page_shows_usage_and_sets_quotas(admin_client, alice):
    from tasks_app.models import OwnerQuota

    make_response(alice, [message("user", "a")], status="in_progress", task_status="queued")
    url = reverse("admin:auth_user_change", args=[alice.pk])
    page = admin_client.get(url).content.decode()
    assert "1 queued of 200, 0 running (no limit)" in page  # the defaults from settings
    form = quota_form(alice, max_running="1", max_queued="3", output_tokens_per_minute="")
    answer = admin_client.post(url, form)
    assert answer.status_code == 302, answer.content.decode()[:2000]
    quota = OwnerQuota.objects.get(owner=alice)
    assert (quota.max_running, quota.max_queued, quota.output_tokens_per_minute) == (1, 3, None)
    assert "1 queued of 3, 0 running of 1" in admin_client.get(url).content.decode()


def test_a_user_with_a_conversation_is_deleted_with_all_of_theirs(admin_client, conversation):
    """Deleting a user in the admin takes their responses (a chain whole),
    tasks, events, idempotency keys, usage, quota and tokens with them."""
    from tasks_app.models import IdempotencyKey, OwnerQuota

    alice = conversation[0].owner
    issue_token(owner=alice, scopes=["responses:read"])
    IdempotencyKey.objects.create(owner=alice, key="k", fingerprint="f", task=conversation[1].task)
    OwnerQuota.objects.create(owner=alice)
    assert UsageRecord.objects.filter(owner=alice).exists() and Event.objects.exists()
    url = reverse("admin:auth_user_delete", args=[alice.pk])
    page = admin_client.get(url)
    assert page.status_code == 200 and "Are you sure" in page.content.decode()
    assert admin_client.post(url, {"post": "yes"}).status_code == 302
    assert not get_user_model().objects.filter(pk=alice.pk).exists()
    for model in (Response, Task, Event, ApiToken, IdempotencyKey, OwnerQuota, UsageRecord):
        assert not model.objects.exists(), model
