"""Every stored word can be erased (issue 29, item 6), on the real stack:
``DELETE`` of a response on both APIs (then 404 on GET and as a
``previous_response_id``), a running one stopped with its streams, a user
deleted with everything of theirs, and the retention of stored responses."""

from __future__ import annotations

import time
from datetime import timedelta

import openai
import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone
from openai import OpenAI

from accounts_app.models import ApiToken
from responses_app.models import Response
from tasks_app.models import Event, IdempotencyKey, OwnerQuota, Task, TokenChunk, UsageRecord

from .conftest import LONG_STORY, make_token, parse_sse, request_body, user_message
from .test_streams_e2e import FINAL_EVENTS, Follower
from .test_tasks_e2e import create_task, wait_for, wait_for_events

pytestmark = pytest.mark.e2e


def post(api, body: dict, path: str = "/lmsp/v1/responses", status: int = 200) -> dict:
    answer = api.post(path, json=body)
    assert answer.status_code == status, answer.text
    return answer.json()


def rows_of(response_id: str) -> dict[str, bool]:
    """Which rows a response left, by table."""
    task_ids = list(Task.objects.filter(response_id=response_id).values_list("id", flat=True))
    return {
        "response": Response.objects.filter(id=response_id).exists(),
        "task": bool(task_ids),
        "events": Event.objects.filter(task_id__in=task_ids).exists(),
        "keys": IdempotencyKey.objects.filter(task_id__in=task_ids).exists(),
    }


def test_lmsp_delete_erases_a_response_and_only_its_owner_may(api, stack, token):
    first = post(api, request_body("My name is Ada.", store=True))
    second = post(
        api, request_body("What is my name?", store=True, previous_response_id=first["id"])
    )
    keyed = api.post(
        "/lmsp/v1/responses",
        json=request_body("Hello again.", store=True),
        headers={"Idempotency-Key": "erase-me"},
    ).json()
    assert rows_of(keyed["id"]) == {"response": True, "task": True, "events": True, "keys": True}

    # another owner learns nothing: 404, never 403; a token without the scope: 403
    with stack.client(make_token("bob")) as bob:
        foreign = bob.delete(f"/lmsp/v1/responses/{first['id']}")
        assert foreign.status_code == 404 and foreign.json()["code"] == "response_not_found"
    with stack.client(make_token("alice", ["responses:read"])) as reader:
        assert reader.delete(f"/lmsp/v1/responses/{first['id']}").status_code == 403

    answer = api.delete(f"/lmsp/v1/responses/{first['id']}")
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
    assert answer.headers["lmsp-version"] == "1.0"
    gone = api.get(f"/lmsp/v1/responses/{first['id']}")
    assert gone.status_code == 404 and gone.json()["code"] == "response_not_found"
    continued = api.post(
        "/lmsp/v1/responses", json=request_body("And now?", previous_response_id=first["id"])
    )
    assert continued.status_code == 404
    assert continued.json()["code"] == "response_not_found"
    assert continued.json()["param"] == "previous_response_id"
    assert api.delete(f"/lmsp/v1/responses/{first['id']}").status_code == 404
    assert not any(rows_of(first["id"]).values())
    # its accounting stays (no words in it; the token quota counts it)
    assert UsageRecord.objects.filter(response_id=first["id"]).exists()

    # the later turn stays, without it, and can be continued
    later = api.get(f"/lmsp/v1/responses/{second['id']}").json()
    assert later["previous_response_id"] is None and later["output"] == second["output"]
    post(api, request_body("Go on.", previous_response_id=second["id"]))

    # an idempotency key goes with its response: the same request starts afresh
    assert api.delete(f"/lmsp/v1/responses/{keyed['id']}").status_code == 200
    assert not any(rows_of(keyed["id"]).values())
    again = api.post(
        "/lmsp/v1/responses",
        json=request_body("Hello again.", store=True),
        headers={"Idempotency-Key": "erase-me"},
    ).json()
    assert again["id"] != keyed["id"]

    # a task's result is erased with its task, whatever its store
    task = wait_for(api, create_task(api)["id"])
    assert api.delete(f"/lmsp/v1/responses/{task['response_id']}").status_code == 200
    assert api.get(f"/lmsp/v1/tasks/{task['id']}").status_code == 404
    # an unstored direct response cannot be named: there is nothing left to erase
    unstored = post(api, request_body())
    assert api.delete(f"/lmsp/v1/responses/{unstored['id']}").status_code == 404


def test_openai_delete_answers_openai_shapes(stack, token):
    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key=token, max_retries=0, timeout=120)
    first = client.responses.create(
        model="smollm2:135m", input="My name is Ada.", max_output_tokens=8, temperature=0
    )
    second = client.responses.create(
        model="smollm2:135m",
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=8,
        temperature=0,
    )
    assert first.store is True  # as at OpenAI, stored unless told not to

    stranger = OpenAI(
        base_url=f"{stack.base_url}/v1", api_key=make_token("bob"), max_retries=0, timeout=30
    )
    with pytest.raises(openai.NotFoundError):
        stranger.responses.delete(first.id)

    with stack.client(token) as api:
        answer = api.delete(f"/v1/responses/{first.id}")
        assert answer.status_code == 200, answer.text
        assert answer.json() == {"id": first.id, "object": "response", "deleted": True}
        missing = api.delete(f"/v1/responses/{first.id}")
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "not_found_error"
        assert missing.json()["error"]["code"] == "response_not_found"
        wrong = api.put(f"/v1/responses/{first.id}")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, DELETE"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(
            model="smollm2:135m", input="And now?", previous_response_id=first.id
        )
    assert client.responses.retrieve(second.id).previous_response_id is None

    # the SDK's own call; a background response too
    background = client.responses.create(
        model="smollm2:135m", input="Hi.", max_output_tokens=4, background=True
    )
    client.responses.delete(background.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(background.id)
    assert not any(rows_of(background.id).values())


def test_a_running_response_deleted_stops_and_its_streams_end(api, stack, token):
    # a task followed by a reader
    task = create_task(api, input=[user_message(LONG_STORY)], max_output_tokens=400)
    follower = Follower(stack, token, f"/lmsp/v1/tasks/{task['id']}/events")
    follower.wait_for(3, timeout=120)
    # and a direct stream of a stored response, read as it comes
    with api.stream(
        "POST",
        "/lmsp/v1/responses",
        json=request_body(LONG_STORY, store=True, stream=True, max_output_tokens=400),
    ) as direct:
        assert direct.status_code == 200
        lines = direct.iter_lines()
        head = []
        while not head or head[-1]:  # the first event, to its blank line
            head.append(next(lines))
        first = parse_sse("\n".join(head) + "\n")[0]
        assert first["event"] == "response.created"
        direct_id = first["data"]["response_id"]
        wait_for_events(Task.objects.get(response_id=direct_id).id, 3, timeout=120)

        deleted_at = time.monotonic()
        assert api.delete(f"/lmsp/v1/responses/{task['response_id']}").status_code == 200
        assert api.delete(f"/lmsp/v1/responses/{direct_id}").status_code == 200
        rest = parse_sse("\n".join(lines) + "\n\n")
    # the direct stream says it cannot go on: no final event, no silent end
    assert rest[-1]["event"] == "error" and rest[-1]["id"] is None
    assert rest[-1]["data"]["error"]["code"] == "event_history_expired"
    assert not any(e["event"] in FINAL_EVENTS for e in rest)
    # the follower's ends without a final event; its reconnect: the task is gone
    events = follower.finish(30)
    assert time.monotonic() - deleted_at < 10
    assert not any(e["event"] in FINAL_EVENTS for e in events)
    again = api.get(f"/lmsp/v1/tasks/{task['id']}/events", headers={"Last-Event-ID": "1"})
    assert again.status_code == 404 and again.json()["code"] == "task_not_found"
    for response_id in (task["response_id"], direct_id):
        assert not any(rows_of(response_id).values())
    assert not TokenChunk.objects.exists()
    # the worker let go of both: the next request is answered
    assert post(api, request_body())["status"] in ("completed", "incomplete")


def test_deleting_a_user_with_a_chained_conversation_leaves_no_row_of_theirs(stack, token):
    """Through HTTP: a conversation of three turns (LMSP and OpenAI), a
    task, a keyed request and a running task followed by a stream; then the
    user is deleted in the admin. Nothing of theirs is left, their stream
    ends and their token opens nothing."""
    alice = get_user_model().objects.get(username="alice")
    with stack.client(token) as api:
        first = post(api, request_body("My name is Ada.", store=True))
        second = post(api, request_body("Who am I?", store=True, previous_response_id=first["id"]))
        third = post(
            api,
            {
                "model": "smollm2:135m",
                "input": "Say it again.",
                "previous_response_id": second["id"],
                "max_output_tokens": 8,
            },
            path="/v1/responses",
        )
        api.post(
            "/lmsp/v1/responses", json=request_body(), headers={"Idempotency-Key": "mine"}
        ).raise_for_status()
        wait_for(api, create_task(api)["id"])
        running = create_task(api, input=[user_message(LONG_STORY)], max_output_tokens=400)
        follower = Follower(stack, token, f"/lmsp/v1/tasks/{running['id']}/events")
        follower.wait_for(3, timeout=120)
    bob = make_token("bob")
    with stack.client(bob) as other:
        kept = post(other, request_body(store=True))
    ids = [first["id"], second["id"], third["id"]]
    assert Response.objects.filter(id__in=ids).count() == 3

    admin = get_user_model().objects.create_superuser("root", password="pw")
    browser = Client()
    browser.force_login(admin)
    url = reverse("admin:auth_user_delete", args=[alice.pk])
    assert "Are you sure" in browser.get(url).content.decode()
    assert browser.post(url, {"post": "yes"}).status_code == 302

    assert not get_user_model().objects.filter(username="alice").exists()
    for model in (Response, Task, ApiToken, IdempotencyKey, OwnerQuota, UsageRecord):
        assert not model.objects.filter(owner_id=alice.pk).exists(), model
    assert not Event.objects.filter(task__owner_id=alice.pk).exists()
    assert Event.objects.count() == Event.objects.filter(task__owner__username="bob").count()
    assert not Task.objects.filter(id=running["id"]).exists()
    # the open stream ended; the token opens nothing any more
    events = follower.finish(30)
    assert not any(e["event"] in FINAL_EVENTS for e in events)
    with stack.client(token) as api:
        assert api.get(f"/lmsp/v1/tasks/{running['id']}/events").status_code == 401
    # another owner's work is untouched, and the worker serves it
    with stack.client(bob) as other:
        assert other.get(f"/lmsp/v1/responses/{kept['id']}").status_code == 200
        assert post(other, request_body())["status"] in ("completed", "incomplete")


def test_retention_erases_stored_responses_past_their_days(api, settings):
    old = post(api, request_body(store=True))
    recent = post(api, request_body(store=True))
    background = wait_for(api, create_task(api, store=True)["id"])
    with_next = post(api, request_body(store=True, previous_response_id=old["id"]))
    created = timezone.now() - timedelta(days=3)
    Response.objects.filter(id__in=[old["id"], background["response_id"]]).update(
        created_at=created
    )

    settings.LMSP_RESPONSE_RETENTION_DAYS = 0  # off: kept until deleted
    call_command("lmsp_prune_events")
    assert api.get(f"/lmsp/v1/responses/{old['id']}").status_code == 200

    settings.LMSP_RESPONSE_RETENTION_DAYS = 2
    call_command("lmsp_prune_events")
    for response_id in (old["id"], background["response_id"]):
        assert api.get(f"/lmsp/v1/responses/{response_id}").status_code == 404
        assert not any(rows_of(response_id).values())
    assert api.get(f"/lmsp/v1/tasks/{background['id']}").status_code == 404
    assert api.get(f"/lmsp/v1/responses/{recent['id']}").status_code == 200
    later = api.get(f"/lmsp/v1/responses/{with_next['id']}").json()
    assert later["previous_response_id"] is None
