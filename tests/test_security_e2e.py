"""Security II (issue 29), through HTTP on the real stack: a hostile megabyte
is refused at once while its web process goes on serving others, every
stream route is capped (per process, token and owner), the admin works
behind a TLS-terminating proxy, inputs that answered 500 answer 4xx, an
owner over quota is refused before any grammar compile, and a web process
runs a bounded number of compiles at once."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from datetime import timedelta

import httpx
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from lmsp_project.devstack import free_port
from tasks_app.models import OwnerQuota, Task, TaskKind, UsageRecord

from .conftest import make_token, request_body
from .test_hostile_input_e2e import _read_answer, tool
from .test_streams_e2e import _raw_stream
from .test_tasks_e2e import create_task

pytestmark = pytest.mark.e2e

LIMIT = 1_000_000  # LMSP_MAX_BODY_BYTES


def _megabyte(head: str, filler: str, tail: str = "") -> bytes:
    """``head``, ``filler`` as often as fits, ``tail``: a body at the size limit."""
    room = LIMIT - len(head.encode()) - len(tail.encode())
    return (head + filler * (room // len(filler.encode())) + tail).encode()


REQUEST = '{"model": "smollm2:135m", "input": '
TEXT = REQUEST + '[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "'
END_TEXT = '"}]}]}'
PART = '{"type": "input_text", "text": ""}'
# 270 messages of 100 parts (the most per message), the very last part wrong.
PARTS = (
    REQUEST
    + "["
    + ", ".join(
        '{"type": "message", "role": "user", "content": ['
        + ", ".join([PART] * (99 if item == 269 else 100))
        + (', {"type": "input_txt", "text": ""}' if item == 269 else "")
        + "]}"
        for item in range(270)
    )
    + "]}"
).encode()

# name: (body, the problem's code, its param; None: "starts with" in DEEP_PARAM)
SHAPES = {
    "an unterminated string of escaped quotes": (
        _megabyte(REQUEST + '"', '\\"'),
        "invalid_request",
        "body",
    ),
    "brackets in a string that never ends": (_megabyte(TEXT, "[{"), "invalid_request", "body"),
    "brackets in a string": (_megabyte(TEXT, "[{", END_TEXT), "context_length_exceeded", "input"),
    "backslashes in a string that never ends": (
        _megabyte(TEXT, "\\\\"),
        "invalid_request",
        "body",
    ),
    "backslashes in a string": (
        _megabyte(TEXT, "\\\\", END_TEXT),
        "context_length_exceeded",
        "input",
    ),
    "a number a megabyte long": (
        _megabyte('{"model": "smollm2:135m", "max_output_tokens": ', "1", "}"),
        "invalid_request",
        "max_output_tokens",
    ),
    "quotes": (_megabyte("", '"'), "invalid_request", "body"),
    "brackets that never close": (
        _megabyte('{"model": "smollm2:135m", "extensions": ', "["),
        "invalid_request",
        "body",
    ),
    "brackets nested a quarter of a million deep": (
        ('{"extensions": {"a": ' + "[" * 249_990 + "]" * 249_990 + "}}").encode(),
        "invalid_request",
        None,
    ),
    "empty arrays, then a wrong model": (
        _megabyte('{"extensions": {"a": [', "[], ", '[]]}, "model": 1}'),
        "invalid_request",
        "model",
    ),
    "empty objects, then a wrong model": (
        _megabyte('{"extensions": {"a": [', "{}, ", '{}]}, "model": 1}'),
        "invalid_request",
        "model",
    ),
    "numbers, then U+0000": (
        _megabyte('{"extensions": {"x": [', "0,", '"\\u0000"]}}'),
        "invalid_request",
        None,
    ),
    "27,000 content parts, the last of an unknown type": (
        PARTS,
        "invalid_request",
        "input[269].content[99].type",
    ),
}
DEEP_PARAM = {
    "brackets nested a quarter of a million deep": "extensions.a[0][0][0]",
    "numbers, then U+0000": "extensions.x[",
}


def _post(port: int, token: str, path: str, body: bytes) -> socket.socket:
    """``body`` sent whole to ``path``; the socket to read the answer from."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _refused_while_others_are_served(stack, token: str, path: str, body: bytes) -> dict:
    """POST ``body``; while the web process works on it, ask it for the model
    list. The problem (or OpenAI's error object), after checking that both
    were answered, the hostile one with a 4xx, by a web process still
    running. (How soon is a bench's question, not a test's.)"""
    assert len(body) <= LIMIT
    answered: list = []
    with _post(stack.port, token, path, body) as sock:
        sent = time.monotonic()
        reader = threading.Thread(
            target=lambda: answered.append((*_read_answer(sock, 60), time.monotonic() - sent))
        )
        reader.start()
        with stack.client(token) as other:
            listed = other.get("/lmsp/v1/models")
        listed_after = time.monotonic() - sent
        reader.join(60)
    assert answered, "no answer to the hostile body within 60 s"
    status, _, problem, answered_after = answered[0]
    print(f"{path}: {status} after {answered_after:.3f} s; the models after {listed_after:.3f} s")
    assert listed.status_code == 200, listed.text
    assert 400 <= status < 500, problem
    assert stack.web.process.poll() is None, "the web process exited"
    return problem.get("error", problem)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_hostile_megabyte_is_refused_at_once_while_the_process_serves_others(stack, token, shape):
    body, code, param = SHAPES[shape]
    problem = _refused_while_others_are_served(stack, token, "/lmsp/v1/responses", body)
    assert problem["code"] == code, problem
    if param is None:
        assert problem["param"].startswith(DEEP_PARAM[shape]), problem
    else:
        assert problem["param"] == param, problem
    assert not Task.objects.exists()


@pytest.mark.parametrize(
    "path, body",
    [
        ("/lmsp/v1/tasks", _megabyte('{"type": "response", "request": "', '\\"')),
        (
            "/lmsp/v1/tasks",
            _megabyte('{"type": "response", "request": ' + TEXT[len(REQUEST) :], "["),
        ),
        ("/v1/responses", _megabyte('{"model": "smollm2:135m", "input": "', '\\"')),
        ("/v1/chat/completions", _megabyte('{"model": "smollm2:135m", "messages": "', '\\"')),
        ("/v1/chat/completions", _megabyte('{"model": "smollm2:135m", "messages": ', "[")),
    ],
)
def test_every_route_that_reads_json_refuses_them_alike(stack, token, path, body):
    problem = _refused_while_others_are_served(stack, token, path, body)
    assert problem["code"] == "invalid_request" and problem["param"] == "body", problem


# --- stream caps ------------------------------------------------------------------------


@pytest.fixture
def capped(stack, restart_after):
    """A web process of its own with small caps (2 streams per token, 3 per
    owner), and the model worker paused: what is followed stays queued, its
    streams open."""
    stack.pause_worker()
    port = free_port()
    proc = stack.another_web(
        port, "web-capped-owner", LMSP_MAX_STREAMS_PER_TOKEN="2", LMSP_MAX_STREAMS_PER_OWNER="3"
    )
    proc.start()
    yield port
    proc.stop()


def _refused_overloaded(sock: socket.socket, status: int, head: str) -> None:
    assert status == 503, head
    assert "retry-after: 5" in head.lower(), head
    sock.close()


def test_openai_follower_streams_are_capped_per_token_and_per_owner(stack, token, capped):
    alice_too, bob = make_token("alice"), make_token("bob")
    with stack.client(token) as client:
        started = client.post("/v1/responses", json={**request_body(), "background": True})
        assert started.status_code == 200, started.text
    follow = f"/v1/responses/{started.json()['id']}?stream=true"
    held = [_raw_stream(capped, token, follow) for _ in range(2)]
    assert [status for _, status, _ in held] == [200, 200], held
    _refused_overloaded(*_raw_stream(capped, token, follow))  # the token's third
    held.append(_raw_stream(capped, alice_too, follow))
    assert held[-1][1] == 200  # another token of alice's: the owner's third
    _refused_overloaded(*_raw_stream(capped, alice_too, follow))  # the owner's fourth
    task = create_task(stack.client(token), max_output_tokens=4)  # caps span the routes
    _refused_overloaded(*_raw_stream(capped, alice_too, f"/lmsp/v1/tasks/{task['id']}/events"))
    with stack.client(bob) as client:  # another owner is not counted with alice
        theirs = client.post("/v1/responses", json={**request_body(), "background": True})
    bob_stream = _raw_stream(capped, bob, f"/v1/responses/{theirs.json()['id']}?stream=true")
    assert bob_stream[1] == 200
    held.pop(0)[0].close()  # a closed stream gives its place back
    deadline = time.monotonic() + 20
    while True:
        sock, status, _ = _raw_stream(capped, alice_too, follow)
        sock.close()
        if status == 200:
            break
        assert time.monotonic() < deadline, "a closed stream kept its place"
        time.sleep(0.2)
    for sock, _, _ in [*held, bob_stream]:
        sock.close()


def _direct_stream(port: int, token: str, key: str) -> tuple[socket.socket, int, str]:
    body = json.dumps(request_body(stream=True, max_output_tokens=4)).encode()
    return _raw_stream(port, token, "/lmsp/v1/responses", body, f"Idempotency-Key: {key}\r\n")


def test_replays_of_a_direct_stream_count_against_the_caps(stack, token, capped):
    """A direct stream's own answer is bounded by the model's queue; its
    replays (the same Idempotency-Key) follow the same generation and count."""
    first = _direct_stream(capped, token, "replayed")
    assert first[1] == 200, first[2]
    replays = [_direct_stream(capped, token, "replayed") for _ in range(2)]
    assert [status for _, status, _ in replays] == [200, 200]
    _refused_overloaded(*_direct_stream(capped, token, "replayed"))
    for sock, _, _ in [first, *replays]:
        sock.close()


# --- the admin behind a TLS-terminating proxy -----------------------------------------

PUBLIC = "https://lmsp.example.org"
FORWARDED = {"X-Forwarded-Proto": "https"}


def _cookies(answer: httpx.Response) -> dict[str, str]:
    """Set-Cookie lines by name (httpx would not send back a Secure cookie over http)."""
    return {line.split("=", 1)[0]: line for line in answer.headers.get_list("set-cookie")}


def _value(cookie_line: str) -> str:
    return cookie_line.split(";", 1)[0].split("=", 1)[1]


def _admin_login(port: int) -> tuple[httpx.Response, httpx.Response, httpx.Client]:
    """The login page and the login, as a browser at ``PUBLIC`` sends them
    through a proxy that forwards them over plain HTTP."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    page = client.get("/admin/login/", headers=FORWARDED)
    assert page.status_code == 200, page.text
    csrf = _value(_cookies(page)["csrftoken"])
    form_token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
    login = client.post(
        "/admin/login/?next=/admin/",
        data={"csrfmiddlewaretoken": form_token, "username": "root", "password": "pw-29"},
        headers={
            **FORWARDED,
            "Origin": PUBLIC,
            "Referer": f"{PUBLIC}/admin/login/",
            "Cookie": f"csrftoken={csrf}",
        },
    )
    return page, login, client


def test_the_admin_login_works_behind_a_tls_proxy(stack, transactional_db):
    get_user_model().objects.create_superuser("root", "root@example.org", "pw-29")
    port = free_port()
    proxied = stack.another_web(
        port,
        "web-proxied",
        LMSP_BEHIND_TLS_PROXY="1",
        LMSP_TRUSTED_PROXIES="127.0.0.1",  # the test is the proxy
        LMSP_CSRF_TRUSTED_ORIGINS=PUBLIC,
        LMSP_HSTS_SECONDS="3600",
    )
    proxied.start()
    try:
        page, login, client = _admin_login(port)
        assert page.headers["strict-transport-security"] == "max-age=3600"
        assert "secure" in _cookies(page)["csrftoken"].lower()
        assert login.status_code == 302 and login.headers["location"] == "/admin/", login.text
        session = _cookies(login)["sessionid"]
        assert "secure" in session.lower()
        index = client.get(
            "/admin/", headers={**FORWARDED, "Cookie": f"sessionid={_value(session)}"}
        )
        client.close()
        assert index.status_code == 200 and "Site administration" in index.text
    finally:
        proxied.stop()
    # the stack's web process, configured for nothing of this, refuses the same login
    page, login, client = _admin_login(stack.port)
    client.close()
    assert "strict-transport-security" not in page.headers
    assert login.status_code == 403 and "CSRF" in login.text


# --- inputs that answered 500 --------------------------------------------------------------


def test_inputs_that_answered_500_answer_4xx(stack, token, transactional_db):
    with stack.client(token) as client:
        for method, path in [
            ("GET", "/v1/responses/resp_%00"),
            ("GET", "/v1/responses/resp_%00?stream=true"),
            ("GET", "/v1/responses/%00"),
            ("POST", "/v1/responses/resp_%00/cancel"),
        ]:
            answer = client.request(method, path)
            assert answer.status_code == 404, (path, answer.text)
            assert answer.json()["error"]["code"] == "response_not_found"
        started = client.post("/v1/responses", json={**request_body(), "background": True})
        follow = f"/v1/responses/{started.json()['id']}?stream=true"
        for value in ("²", "-2", "1" * 5000, "%00"):
            answer = client.get(f"{follow}&starting_after={value}")
            assert answer.status_code == 400, (value, answer.text)
            assert answer.json()["error"]["param"] == "starting_after"
        assert client.get(f"{follow}&starting_after=-1").status_code == 200
    get_user_model().objects.create_superuser("root", "root@example.org", "pw-29")
    with httpx.Client(base_url=stack.base_url, timeout=30) as admin:
        page = admin.get("/admin/login/")
        form_token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text).group(1)
        login = admin.post(
            "/admin/login/?next=/admin/",
            data={"csrfmiddlewaretoken": form_token, "username": "root", "password": "pw-29"},
        )
        assert login.status_code == 302, login.text
        for path in (
            "/admin/responses_app/response/resp_%00/change/",
            "/admin/tasks_app/task/task_%00/change/",
            "/admin/accounts_app/apitoken/%00/change/",
            "/admin/auth/user/%00/change/",
            "/admin/tasks_app/task/?status=%00",
            "/admin/responses_app/response/?q=%00",
        ):
            answer = admin.get(path)
            assert 200 <= answer.status_code < 500, (path, answer.status_code)


# --- grammar compiles -----------------------------------------------------------------------

UNCOMPILABLE = {"type": "frobnicate"}  # 400 once compiled: it cannot be


def test_an_owner_over_quota_is_refused_before_any_compile(api, token):
    alice = get_user_model().objects.get(username="alice")
    body = request_body(tools=[tool(UNCOMPILABLE)])
    answer = api.post("/lmsp/v1/responses", json=body)  # under quota: compiled, refused
    assert answer.status_code == 400 and answer.json()["param"] == "tools[0].parameters"
    OwnerQuota.objects.update_or_create(owner=alice, defaults={"output_tokens_per_minute": 10})
    UsageRecord.objects.create(
        response_id="resp_01J8M6Q4W2T7N5R3V9X1Z8B0DF",
        owner=alice,
        model="smollm2:135m",
        kind=TaskKind.DIRECT,
        status="completed",
        output_tokens=50,
        created_at=timezone.now() - timedelta(seconds=5),
        completed_at=timezone.now() - timedelta(seconds=5),
    )
    for path, sent in [
        ("/lmsp/v1/responses", body),
        ("/lmsp/v1/tasks", {"type": "response", "request": body}),
    ]:
        answer = api.post(path, json=sent)
        assert answer.status_code == 429, answer.text  # not 400: nothing was compiled
        assert answer.json()["quota"] == "output_tokens_per_minute"
    assert not Task.objects.exists()


def test_a_web_process_runs_a_bounded_number_of_compiles_at_once(stack, token):
    """One compile at a time, a wait of 0.2 s for it: while one schema that
    takes seconds to compile holds the slot, two requests sent during it are
    refused with 503 and Retry-After.

    The compile that holds the slot must be slow on purpose: a small schema
    compiles in about 0.06 s once the process has its tokenizer, less than two
    requests sent "together" may lie apart on a loaded machine (a CI run saw
    two of three small ones compiled one after the other)."""
    port = free_port()
    bounded = stack.another_web(
        port,
        "web-compiles",
        LMSP_GRAMMAR_CONCURRENCY="1",
        LMSP_GRAMMAR_WAIT_SECONDS="0.2",
        LMSP_GRAMMAR_TIMEOUT_SECONDS="60",
        LMSP_MAX_PATTERN_REPEAT="8000",
    )
    answers: dict[int, httpx.Response] = {}

    def ask(index: int, schema: dict) -> None:
        body = request_body(tools=[tool(schema)], tool_choice="required", stream=True)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
            headers = {"Authorization": f"Bearer {token}"}
            with client.stream("POST", "/lmsp/v1/responses", json=body, headers=headers) as answer:
                if answer.status_code != 200:
                    answer.read()
                answers[index] = answer  # a stream left at once: its generation is cancelled

    def small(index: int) -> dict:
        return {"type": "object", "properties": {f"p{index}": {"type": "string"}}}

    # 3 s or more here (the vocabulary is matched against 8,000 states)
    slow = {"type": "object", "properties": {"code": {"type": "string", "pattern": "a{8000}"}}}
    bounded.start()
    try:
        ask(0, small(0))  # the process's first compile also reads the tokenizer for the compiler
        assert answers.pop(0).status_code == 200
        holding = threading.Thread(target=ask, args=(1, slow))
        holding.start()
        time.sleep(1.0)  # its compile has begun
        asking = [threading.Thread(target=ask, args=(index, small(index))) for index in (2, 3)]
        for thread in asking:
            thread.start()
        for thread in [holding, *asking]:
            thread.join(180)
    finally:
        bounded.stop()
    assert answers[1].status_code == 200, answers[1].text
    assert [answers[2].status_code, answers[3].status_code] == [503, 503]
    for answer in (answers[2], answers[3]):
        assert answer.json()["code"] == "overloaded"
        assert answer.headers["retry-after"] == "60"
