"""Erasure leaves no copy (issue 46, "Security III"), on the real stack: a
secret sent in the first turn of a conversation, continued by a second, is
found by no ``SELECT`` over any text, JSON or bytea column of any table once
the first turn is erased (``DELETE``, retention, or its owner deleted); the
conversation goes on from what remains; the workers are told which owner's
words went (``lmsp_core.erasure_news``); and an unstored response kept for
an ``Idempotency-Key`` is erasable by its owner."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.db import connection
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from generation.registry import get_model
from lmsp_core.erasure_news import CHANNEL
from lmsp_core.redis_client import redis_client
from responses_app.models import Response
from responses_app.prompting import prompt_of

from .conftest import make_token, output_text, request_body
from .test_erasure_e2e import post, rows_of

pytestmark = pytest.mark.e2e

SPEC = get_model("smollm2:135m")
# Many tokens long, so that an answer of a few tokens cannot hold it whole.
SECRET = "QX7-PLUM-4421-ZEBRA-9083"
TOLD = f"The vault code is {SECRET}. Remember it."

# The columns that can hold words: text, JSON and bytes, of every table.
WORDY_COLUMNS = """
SELECT c.table_name, c.column_name, c.data_type
  FROM information_schema.columns c
  JOIN information_schema.tables t USING (table_schema, table_name)
 WHERE c.table_schema = current_schema() AND t.table_type = 'BASE TABLE'
   AND c.data_type IN ('text', 'character varying', 'character', 'json', 'jsonb', 'bytea')
 ORDER BY 1, 2
"""


def places_holding(text: str) -> list[str]:
    """Every ``table.column`` of the database where a row holds ``text``."""
    quote = connection.ops.quote_name
    found = []
    with connection.cursor() as cursor:
        cursor.execute(WORDY_COLUMNS)
        columns = cursor.fetchall()
        assert len(columns) > 20  # the scan does see the schema
        for table, column, kind in columns:
            if kind == "bytea":
                test, value = f"position(%s::bytea in {quote(column)}) > 0", text.encode()
            else:
                test, value = f"strpos({quote(column)}::text, %s) > 0", text
            cursor.execute(f"SELECT EXISTS (SELECT FROM {quote(table)} WHERE {test})", [value])
            if cursor.fetchone()[0]:
                found.append(f"{table}.{column}")
    return found


class ErasureNews:
    """The erasure messages published on Redis while it listens."""

    def __init__(self) -> None:
        self.pubsub = redis_client().pubsub(ignore_subscribe_messages=True)
        self.pubsub.subscribe(CHANNEL)
        self.pubsub.get_message(timeout=1)  # the subscription's confirmation

    def owners(self, timeout: float = 10) -> list[int]:
        """The owners the next message names ([] when none comes in ``timeout``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            message = self.pubsub.get_message(timeout=0.5)
            if message is not None:
                return json.loads(message["data"])["owners"]
        return []


@pytest.fixture
def news() -> Iterator[ErasureNews]:
    listening = ErasureNews()
    yield listening
    listening.pubsub.close()


def conversation(api) -> tuple[dict, dict]:  # noqa: ANN001
    """Two stored turns: the secret told, then a second turn too short to repeat it."""
    first = post(api, request_body(TOLD, store=True, max_output_tokens=8))
    second = post(
        api,
        request_body(
            "Now say hello.", store=True, max_output_tokens=3, previous_response_id=first["id"]
        ),
    )
    assert SECRET not in output_text(second)  # its own words cannot hold the secret
    assert places_holding(SECRET)  # the scan finds it while it is kept
    return first, second


def continues_without_the_secret(api, second: dict) -> None:  # noqa: ANN001
    """The conversation goes on from what remains, and nothing holds the secret."""
    later = Response.objects.get(id=second["id"])
    assert later.previous_response_id is None
    # what a run of the second turn reads now: its own words, not the erased ones
    context = prompt_of(later, SPEC)
    assert "Now say hello." in context and SECRET not in context
    third = post(api, request_body("Say goodbye.", store=True, previous_response_id=second["id"]))
    assert third["status"] in ("completed", "incomplete") and output_text(third).strip()
    assert third["previous_response_id"] == second["id"]
    context = prompt_of(Response.objects.get(id=third["id"]), SPEC)
    assert "Now say hello." in context and "Say goodbye." in context
    assert SECRET not in context
    assert places_holding(SECRET) == []


def test_a_deleted_turn_leaves_its_words_in_no_row(api, news):
    first, second = conversation(api)
    owner = Response.objects.get(id=first["id"]).owner_id

    assert api.delete(f"/lmsp/v1/responses/{first['id']}").status_code == 200
    assert places_holding(SECRET) == []
    assert news.owners() == [owner]
    continues_without_the_secret(api, second)


def test_retention_leaves_the_words_of_an_expired_turn_in_no_row(api, news, settings):
    first, second = conversation(api)
    owner = Response.objects.get(id=first["id"]).owner_id
    Response.objects.filter(id=first["id"]).update(created_at=timezone.now() - timedelta(days=3))

    settings.LMSP_RESPONSE_RETENTION_DAYS = 2
    call_command("lmsp_prune_events")
    assert api.get(f"/lmsp/v1/responses/{first['id']}").status_code == 404
    assert places_holding(SECRET) == []
    assert news.owners() == [owner]
    continues_without_the_secret(api, second)


def test_a_deleted_owner_leaves_no_row_and_the_workers_are_told(api, news):
    conversation(api)
    alice = get_user_model().objects.get(username="alice")
    staff = get_user_model().objects.create_superuser("root", password="pw")
    browser = Client()
    browser.force_login(staff)
    url = reverse("admin:auth_user_delete", args=[alice.pk])
    assert browser.post(url, {"post": "yes"}).status_code == 302
    assert places_holding(SECRET) == []
    assert news.owners() == [alice.pk]


def test_an_unstored_keyed_response_is_erasable_by_its_owner(api, stack, news):
    keyed = api.post(
        "/lmsp/v1/responses",
        json=request_body(TOLD, store=False),
        headers={"Idempotency-Key": "keep-for-retry"},
    )
    assert keyed.status_code == 200, keyed.text
    answer = keyed.json()
    assert answer["store"] is False
    # kept for a retry with the key, and holding the secret meanwhile
    assert rows_of(answer["id"]) == {"response": True, "task": True, "events": True, "keys": True}
    assert places_holding(SECRET)
    # not readable, and nobody else may erase it, but its owner may
    assert api.get(f"/lmsp/v1/responses/{answer['id']}").status_code == 404
    with stack.client(make_token("bob")) as bob:
        assert bob.delete(f"/lmsp/v1/responses/{answer['id']}").status_code == 404
    erased = api.delete(f"/lmsp/v1/responses/{answer['id']}")
    assert erased.status_code == 200, erased.text
    assert erased.json() == {"id": answer["id"], "object": "response.deleted", "deleted": True}
    assert not any(rows_of(answer["id"]).values())
    assert places_holding(SECRET) == []
    assert news.owners() == [get_user_model().objects.get(username="alice").pk]
    # the key is free again: the same request starts afresh
    again = api.post(
        "/lmsp/v1/responses",
        json=request_body(TOLD, store=False),
        headers={"Idempotency-Key": "keep-for-retry"},
    )
    assert again.status_code == 200 and again.json()["id"] != answer["id"]
