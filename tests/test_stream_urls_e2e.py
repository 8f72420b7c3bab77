"""Signed stream URLs (``tasks_app.stream_urls``): what a web page's
``EventSource`` opens without an ``Authorization`` header. A URL gives the
task's events as the header does, resumes from ``Last-Event-ID``, holds no
part of the token, counts against its token's stream caps and ends with its
token; a tampered, expired, other owner's or other task's URL, one of a
revoked token or of an erased response is refused with a problem document
and no event, alike on the lean path and through Django's handler."""

from __future__ import annotations

import time
from datetime import timedelta
from urllib.parse import parse_qs, quote, urlsplit

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from accounts_app.models import ApiToken
from accounts_app.services import revoke_token
from tasks_app import stream_urls

from .conftest import LONG_STORY, make_token, parse_sse, user_message
from .test_lean_streams_e2e import _exchange, _request, _same, _status, twins  # noqa: F401
from .test_tasks_e2e import create_task, read_events, wait_for, wait_for_events

pytestmark = pytest.mark.e2e


def long_task(client: httpx.Client, max_output_tokens: int) -> dict:
    """A task that runs for seconds (greedy SmolLM2 writes on and on)."""
    return create_task(
        client, input=[user_message(LONG_STORY)], max_output_tokens=max_output_tokens
    )


def stream_url(client: httpx.Client, task_id: str) -> str:
    answer = client.post(f"/lmsp/v1/tasks/{task_id}/stream-url")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["object"] == "stream_url" and body["task_id"] == task_id
    return body["url"]


def anonymous(stack) -> httpx.Client:
    """A client that sends no ``Authorization`` header, as ``EventSource``."""
    return httpx.Client(base_url=stack.base_url, timeout=httpx.Timeout(120, connect=10))


def signed_events(stack, url: str, **headers: str) -> list[dict]:
    with anonymous(stack) as client, client.stream("GET", url, headers=headers) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        return parse_sse("".join(answer.iter_text()))


def with_access(path: str, signed: str) -> str:
    return f"{path}?access={quote(signed)}"


def assert_refused(twins, url: str, status: int, code: str) -> None:  # noqa: F811
    """Refused alike on both paths, with a problem document and no event."""
    raw = _same(twins, url, {})
    assert _status(raw) == status, raw
    assert b"content-type: application/problem+json" in raw, raw
    assert f'"code": "{code}"'.encode() in raw, raw
    assert b"event:" not in raw and b"text/event-stream" not in raw, raw


def test_a_signed_url_gives_the_events_and_resumes_from_last_event_id(api, stack, token):
    done = wait_for(api, create_task(api, max_output_tokens=12)["id"])
    url = stream_url(api, done["id"])
    before = time.time()
    expires_at = api.post(f"/lmsp/v1/tasks/{done['id']}/stream-url").json()["expires_at"]
    # LMSP_STREAM_URL_MINUTES, 10 by default
    assert before + 9 * 60 < expires_at <= time.time() + 10 * 60 + 1
    # no part of the token: neither its secret nor its public prefix
    prefix = token.split("_")[1]
    assert token not in url and prefix not in url
    path, query = urlsplit(url).path, parse_qs(urlsplit(url).query)
    assert path == f"/lmsp/v1/tasks/{done['id']}/events" and list(query) == ["access"]

    by_header = read_events(api, done["id"])
    by_url = signed_events(stack, url)
    assert by_url == by_header
    assert by_url[-1]["event"] in ("response.completed", "response.incomplete")
    # a reconnect (EventSource sends Last-Event-ID) gets exactly what is missing
    for last in (1, 3, len(by_header) - 1):
        assert signed_events(stack, url, **{"Last-Event-ID": str(last)}) == by_header[last:]
    # and nothing after the final event (EventSource stops at 204)
    with anonymous(stack) as client:
        ended = client.get(url, headers={"Last-Event-ID": str(done["last_event_id"])})
    assert ended.status_code == 204 and ended.content == b""


def test_a_live_answer_resumes_through_the_url_without_gap_or_repeat(api, stack, token):
    task = long_task(api, 120)
    url = stream_url(api, task["id"])
    wait_for_events(task["id"], 4)
    seen: list[dict] = []
    with anonymous(stack) as client, client.stream("GET", url) as answer:
        assert answer.status_code == 200
        buffer = ""
        for text in answer.iter_text():
            buffer += text
            blocks = buffer.split("\n\n")
            seen += parse_sse("\n\n".join(blocks[:-1]))
            buffer = blocks[-1]
            if len(seen) >= 6:
                break  # the connection is lost mid-answer
    first_part = [e for e in seen if e["id"] is not None]
    assert len(first_part) >= 6
    rest = signed_events(stack, url, **{"Last-Event-ID": str(first_part[-1]["id"])})
    done = wait_for(api, task["id"])
    whole = first_part + rest
    assert [e["id"] for e in whole] == list(range(1, done["last_event_id"] + 1))
    assert whole == read_events(api, task["id"])
    assert whole[-1]["event"] in ("response.completed", "response.incomplete")


def test_refused_urls_get_a_problem_and_no_event(twins, api, stack, token):  # noqa: F811
    first = wait_for(api, create_task(api, max_output_tokens=2)["id"])
    second = wait_for(api, create_task(api, max_output_tokens=2)["id"])
    url = stream_url(api, first["id"])
    signed = parse_qs(urlsplit(url).query)["access"][0]
    # the valid URL opens on both paths, byte for byte alike
    assert _status(_same(twins, url, {})) == 200
    assert _status(_same(twins, url, {"Last-Event-ID": "1"})) == 200

    # tampered: one character of the signature, or of the signed part
    events = urlsplit(url).path
    assert with_access(events, signed) == url
    payload, _, signature = signed.rpartition(":")
    flipped = signature[:-1] + ("A" if signature[-1] != "A" else "B")
    for tampered in (f"{payload}:{flipped}", "x" + signed[1:], "nonsense", ""):
        assert_refused(twins, with_access(events, tampered), 401, "unauthorized")

    # another task's: the URL of one task on the path of another
    assert_refused(twins, url.replace(first["id"], second["id"]), 404, "task_not_found")

    # another owner's: mallory cannot get a URL for alice's task, and her own
    # URL does not open alice's
    mallory = make_token("mallory")
    with stack.client(mallory) as client:
        assert client.post(f"/lmsp/v1/tasks/{first['id']}/stream-url").status_code == 404
        theirs = create_task(client, max_output_tokens=2)
        their_url = stream_url(client, theirs["id"])
        wait_for(client, theirs["id"])
    assert_refused(twins, their_url.replace(theirs["id"], first["id"]), 404, "task_not_found")

    # expired: signed as the service signs (the test process shares its key),
    # long enough ago
    alice_token = ApiToken.objects.get(prefix=token.split("_")[1])
    old, _ = stream_urls.issue(first["id"], alice_token, timezone.now() - timedelta(minutes=11))
    assert_refused(twins, old, 401, "unauthorized")

    # the owner deactivated: refused while it lasts
    User = get_user_model()
    User.objects.filter(pk=alice_token.owner_id).update(is_active=False)
    try:
        assert_refused(twins, url, 401, "unauthorized")
    finally:
        User.objects.filter(pk=alice_token.owner_id).update(is_active=True)
    assert _status(_same(twins, url, {})) == 200

    # the response erased (DELETE): its task and events are gone
    second_url = stream_url(api, second["id"])
    assert _status(_same(twins, second_url, {})) == 200
    assert api.delete(f"/lmsp/v1/responses/{second['response_id']}").status_code == 200
    assert_refused(twins, second_url, 404, "task_not_found")

    # the token revoked: its URLs open nothing
    revoke_token(token.split("_")[1])
    assert_refused(twins, url, 401, "unauthorized")


def test_signed_streams_count_against_their_token_and_end_with_it(twins, api, stack, token):  # noqa: F811
    """Two streams per token in the twins (CAPS): two signed streams of a token
    take its places, and a header stream of the same token is refused; when
    the token is revoked, its signed streams end without a final event."""
    lean, _ = twins
    task = long_task(api, 400)
    url = stream_url(api, task["id"])
    held = []
    for _ in range(2):
        sock = _request(lean, url, {"Connection": "close"})
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(65536)
        assert raw.startswith(b"HTTP/1.1 200 OK"), raw
        held.append((sock, raw))
    refused = _exchange(lean, url.split("?")[0], {"Authorization": f"Bearer {token}"})
    assert _status(refused) == 503 and b'"code": "overloaded"' in refused
    assert _status(_exchange(lean, url, {})) == 503
    wait_for_events(task["id"], 6)  # the answer is under way
    revoke_token(token.split("_")[1])
    for sock, body in held:
        sock.settimeout(30)
        while chunk := sock.recv(65536):
            body += chunk
        sock.close()
        assert b"event: response.created" in body
        assert b"response.completed" not in body and b"response.cancelled" not in body
    assert _status(_exchange(lean, url, {})) == 401
